"""Speed: triton_flash against torch SDPA's flash, cuDNN and efficient backends.

Shapes (bfloat16): (4, 16, 4096, 128) full and causal, the same at D = 64, grouped
query 32/8, and decode (Lq = 1 and 16 against Lk = 32768, grouped query 32/8). Each
figure: median seconds (CUDA events on a GPU, the wall clock on CPU), TFLOP/s, and
the ratio of each SDPA backend's time to triton_flash's (above 1: triton_flash is
faster). SDPA backends that refuse a shape are recorded with their error. On CPU
(``scale`` > 1) the shapes shrink and SDPA's math backend stands in.

Packed documents under a causal mask, (1, 16, 8192, 128): triton_flash per call
(binding the mask, its block form and bit tiles included) and with its plan built once
(the kernels alone), against FlexAttention (``create_block_mask`` once, compiled on a
GPU) and SDPA with the equivalent dense boolean mask.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

#: (name, (B, Hq, Hkv, Lq, Lk, D), causal)
SHAPES = [
    ("forward_full", (4, 16, 16, 4096, 4096, 128), False),
    ("forward_causal", (4, 16, 16, 4096, 4096, 128), True),
    ("forward_full_d64", (4, 16, 16, 4096, 4096, 64), False),
    ("forward_causal_d64", (4, 16, 16, 4096, 4096, 64), True),
    ("gqa_32_8_causal", (4, 32, 8, 4096, 4096, 128), True),
    ("decode_1", (4, 32, 8, 1, 32768, 128), False),
    ("decode_16_causal", (4, 32, 8, 16, 32768, 128), True),
]
#: (name, (B, H, L, D), document lengths packed into L), under a causal mask
DOCUMENT_SHAPES = [
    ("documents_causal", (1, 16, 8192, 128), (1500, 300, 2500, 892, 1000, 2000)),
]
#: Targets (ratio of the named SDPA figure's time to triton_flash's, at least).
TARGETS = {"forward_full": ("sdpa_flash", 1.0), "forward_causal": ("sdpa_flash", 1.0),
           "decode_1": ("sdpa_best", 1.0), "decode_16_causal": ("sdpa_best", 1.0)}


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs of ``Q K^T`` and ``P V`` (the convention flash-attention reports):
    ``4 B H Lq Lk D``, halved under a causal mask of a square score matrix."""
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    return flops / 2 if causal and q_len == kv_len else flops


def median_time(fn: Callable[[], Any], device: str, warmup: int = 3,
                repeats: int = 20) -> float:
    """Median seconds per call."""
    import torch

    for _ in range(warmup):
        fn()
    if device != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def sdpa_backends(device: str) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    if device != "cuda":
        return {"sdpa_math": SDPBackend.MATH}
    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def _scaled(dims: tuple[int, ...], scale: int) -> tuple[int, ...]:
    _, hq, hkv, lq, lk, d = dims
    return (1, hq // 4 or 1, hkv // 4 or 1, lq if lq <= 16 else max(16, lq // scale),
            max(16, lk // scale), d) if scale > 1 else dims


def time_shape(name: str, dims: tuple[int, ...], causal: bool, device: str,
               variants: dict[str, dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Figures of one shape: triton_flash in each ``variants`` entry (keyword
    arguments of ``flash_forward``) and each SDPA backend."""
    import torch
    from portattn_triton import flash_forward
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b, hq, hkv, lq, lk, d = dims
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, hq, lq, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, hkv, lk, d, device=device, dtype=dtype, generator=gen)
            for _ in range(2))
    flops = attention_flops(b, hq, lq, lk, d, causal)
    # SDPA's is_causal is top-left; bottom-right (the KV-cache meaning) for Lq != Lk
    # is the same band as top-left only when Lq == Lk, so decode passes a bool mask.
    mask = None
    if causal and lq != lk:
        i = torch.arange(lq, device=device)[:, None] + (lk - lq)
        mask = torch.arange(lk, device=device)[None, :] <= i
    row: dict[str, Any] = {"name": name, "shape": dims, "causal": causal,
                           "dtype": str(dtype).rsplit(".", 1)[-1], "flops": flops}

    def ours(options: dict[str, Any]) -> Any:
        return flash_forward(q, k, v, causal="bottom_right" if causal else None,
                             **options)[0]

    reference = None
    for label, options in variants.items():
        try:
            out = ours(options)
            reference = out if reference is None else reference
            seconds = median_time(lambda o=options: ours(o), device, repeats=repeats)
        except Exception as e:  # a variant this device cannot run is a figure, not a crash
            row[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        row[label] = {"seconds": seconds, "tflops": flops / seconds / 1e12}
    row["dispatched"] = dispatched(q, k, v, causal, flops, device, repeats)
    for label, backend in sdpa_backends(device).items():
        def theirs(backend=backend) -> Any:
            with sdpa_kernel(backend):
                return sdpa(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                            enable_gqa=hq != hkv)
        try:
            out = theirs()
            seconds = median_time(theirs, device, repeats=repeats)
        except Exception as e:  # e.g. a backend that does not take this shape or mask
            row[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        entry = {"seconds": seconds, "tflops": flops / seconds / 1e12}
        if reference is not None:
            entry["max_abs_diff"] = (out.float() - reference.float()).abs().max().item()
        row[label] = entry
    timed = {n: e["seconds"] for n, e in row.items()
             if isinstance(e, dict) and "seconds" in e}
    sdpa_times = {n: t for n, t in timed.items() if n.startswith("sdpa_")}
    if sdpa_times:
        best = min(sdpa_times, key=sdpa_times.get)
        row["sdpa_best"] = {"backend": best, "seconds": sdpa_times[best]}
        if "dispatched" in timed:  # the promise: never slower than what torch has
            row["dispatched"]["vs_sdpa_best"] = timed["dispatched"] / sdpa_times[best]
    ours_time = timed.get("triton_flash")
    if ours_time:
        row["ratios"] = {n: t / ours_time for n, t in timed.items() if n != "triton_flash"}
        if sdpa_times:
            row["ratios"]["sdpa_best"] = sdpa_times[best] / ours_time
    return row


def dispatched(q: Any, k: Any, v: Any, causal: bool, flops: float, device: str,
               repeats: int, grad: Any = None) -> dict[str, Any]:
    """The time of ``portattn.attention`` as a user calls it (dispatch, its per-call
    work and the kernel it picks; with ``grad``, forward and backward), and the kernel
    it picked."""
    import torch

    import portattn
    from portattn import masks

    mask = masks.causal() if causal else None
    try:
        picked = portattn.explain(q, k, v, mask=mask).kernel.name

        def call() -> Any:
            out = portattn.attention(q, k, v, mask=mask)
            return out if grad is None else torch.autograd.grad(out, (q, k, v), grad)

        call()
        seconds = median_time(call, device, repeats=repeats)
    except Exception as e:  # a figure, not a crash
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {"kernel": picked, "seconds": seconds, "tflops": flops / seconds / 1e12}


def document_ids(sizes: tuple[int, ...], length: int, scale: int) -> list[int]:
    """Segment ids of documents of ``sizes`` (divided by ``scale``, the last one filling
    the row) packed into ``length`` positions."""
    sizes = [max(1, n // scale) for n in sizes]
    sizes[-1] += length - sum(sizes)
    return [i for i, n in enumerate(sizes) for _ in range(n)][:length]


def time_documents(name: str, dims: tuple[int, ...], sizes: tuple[int, ...], device: str,
                   scale: int, repeats: int) -> dict[str, Any]:
    """Figures of packed documents under a causal mask (see the module doc)."""
    import torch
    from portattn_triton._launch import forward
    from portattn_triton._plan import plan_for

    import portattn
    from portattn import masks

    b, h, n, d = dims
    if scale > 1:
        b, h, n = 1, max(1, h // 4), max(64, n // scale)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen)
               for _ in range(3))
    ids = torch.tensor(document_ids(sizes, n, scale), device=device)
    mask = masks.causal() & masks.documents(ids)
    allowed = (ids[:, None] == ids[None, :]) & torch.ones(n, n, dtype=torch.bool,
                                                          device=device).tril()
    density = allowed.float().mean().item()
    flops = 4.0 * b * h * n * n * d * density  # the pairs the mask allows
    row: dict[str, Any] = {"name": name, "shape": (b, h, n, d), "dtype": str(dtype)[6:],
                           "documents": len(sizes), "allowed": density, "flops": flops}
    plan = plan_for(q, k, mask=mask)
    calls = {
        "triton_flash": lambda: portattn.attention(q, k, v, mask=mask, kernel="triton_flash"),
        "triton_flash_planned": lambda: forward(q, k, v, plan, scale=None, softcap=None)[0],
        "sdpa_dense_mask": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed),
    }
    flex = _flex_attention(ids, n, device)
    if isinstance(flex, str):
        row["flex_attention"] = {"error": flex}
    else:
        calls["flex_attention"] = lambda: flex(q, k, v)
    outputs = {}
    for label, call in calls.items():
        try:
            outputs[label] = call()
            seconds = median_time(call, device, repeats=repeats)
        except Exception as e:  # a peer that cannot run here is a figure, not a crash
            row[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        row[label] = {"seconds": seconds, "tflops": flops / seconds / 1e12}
    ours = outputs.get("triton_flash")
    for label, out in outputs.items():
        if label != "triton_flash" and ours is not None and "seconds" in row[label]:
            row[label]["max_abs_diff"] = (out.float() - ours.float()).abs().max().item()
    timed = {n_: e["seconds"] for n_, e in row.items()
             if isinstance(e, dict) and "seconds" in e}
    if "triton_flash_planned" in timed:
        row["ratios"] = {n_: t / timed["triton_flash_planned"] for n_, t in timed.items()
                         if n_ != "triton_flash_planned"}
    return row


def _flex_attention(ids: Any, length: int, device: str) -> Any:
    """FlexAttention over packed documents with its block mask built once (compiled on
    a GPU: the way it is meant to run), or why it cannot run here."""
    import torch

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return f"no FlexAttention in this torch: {e}"

    def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (ids[q_idx] == ids[kv_idx])

    try:
        block_mask = create_block_mask(document_causal, None, None, length, length,
                                       device=device)
    except Exception as e:  # e.g. a torch whose block masks need another device
        return f"create_block_mask: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    attend = torch.compile(flex_attention) if device == "cuda" else flex_attention
    return lambda q, k, v: attend(q, k, v, block_mask=block_mask)


def autotuned_configs() -> list[dict[str, Any]]:
    """The block sizes ``autotune=True`` chose so far, per kind of call."""
    from portattn_triton import _autotune

    return [{"kind": repr(kind), "config": str(config)}
            for kind, config in _autotune._chosen.items()]


#: ``portattn.attention`` may take at most this many times the time of the fastest SDPA
#: backend for the same call.
NEVER_SLOWER = 1.02


def run(report: Any, device: str, scale: int = 1, autotune: bool = True,
        repeats: int = 20, shapes: list | None = None,
        documents: list | None = None) -> None:
    """Every shape (or those of ``shapes``) and every packed-documents shape (or those
    of ``documents``) into ``report`` (section ``speed``), with the targets."""
    for name, dims, sizes in DOCUMENT_SHAPES if documents is None else documents:
        row = time_documents(name, dims, sizes, device, scale, repeats)
        report.figure("speed", **row)
        ours = row.get("triton_flash", {})
        if "error" in ours or "error" in row.get("triton_flash_planned", {}):
            report.check("speed", name, "FAIL", ours.get("error")
                         or row["triton_flash_planned"]["error"])
            continue
        detail = (f"{row['triton_flash_planned']['tflops']:.1f} TFLOP/s of allowed pairs "
                  "(planned); " + ", ".join(f"{n} x{r:.2f}"
                                             for n, r in row.get("ratios", {}).items()))
        print(f"  {name:<20} {detail}")
        report.check("speed", name, "ok", detail)
    for name, dims, causal in SHAPES if shapes is None else shapes:
        variants: dict[str, dict[str, Any]] = {"triton_flash": {}}
        if device == "cuda" and not name.startswith("decode"):
            variants["triton_flash_pointer"] = {"path": "pointer"}
            if autotune:  # both paths at their best, to choose each one's default blocks
                variants["triton_flash_autotuned"] = {"autotune": True}
                variants["triton_flash_pointer_autotuned"] = {"path": "pointer",
                                                              "autotune": True}
        row = time_shape(name, _scaled(dims, scale), causal, device, variants, repeats)
        report.figure("speed", **row)
        ours = row.get("triton_flash", {})
        if "error" in ours:
            report.check("speed", name, "FAIL", ours["error"])
            continue
        target = TARGETS.get(name)
        ratio = row.get("ratios", {}).get(target[0]) if target else None
        detail = (f"{ours['tflops']:.1f} TFLOP/s; "
                  + ", ".join(f"{n} x{r:.2f}" for n, r in row.get("ratios", {}).items()))
        through = row.get("dispatched", {})
        if "vs_sdpa_best" in through:  # time through portattn over torch's best
            slower = through["vs_sdpa_best"]
            detail += f"; portattn.attention ran {through['kernel']}, x{slower:.2f} the time"
            report.figure("never_slower", name=name, kernel=through["kernel"],
                          ratio=slower, target=NEVER_SLOWER, met=slower <= NEVER_SLOWER)
        print(f"  {name:<20} {detail}")
        if target and ratio is not None and device == "cuda":
            met = ratio >= target[1]
            report.figure("targets", name=name, against=target[0], ratio=ratio,
                          target=target[1], met=met)
            if not met:
                print(f"    below target: {name} x{ratio:.2f} against {target[0]} "
                      f"(target x{target[1]})")
        report.check("speed", name, "ok", detail)
    if autotune and device == "cuda":
        report.figure("autotuned", configs=autotuned_configs())
