"""Large-size accuracy: triton_flash through dispatch against the float64 reference.

Sizes cross many query blocks and key tiles (L up to 4096, Lq != Lk), every mask
kind, grouped-query heads, softcap, the lse, uneven head dims, and decode shapes (few
queries, long keys). Each case: ``explain()`` must choose triton_flash; the caching
allocator is filled with NaN first, so any output element the kernel fails to write
shows; a second run must be bitwise equal; out and lse are compared with the
``reference`` kernel in float64 within the dtype's tolerance (float32: the float32
tolerance with three-TF32 products, the TF32 one with ``set_float32_matmul_precision
("high")``). CuPy arrays go through DLPack on a non-default CuPy stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: (rtol, atol) for float32 results computed with plain TF32 matmuls (10-bit mantissa).
TF32_TOLERANCE = (5e-3, 5e-3)


@dataclass(frozen=True)
class Case:
    name: str
    dims: tuple[int, ...]  # (B, Hq, Hkv, Lq, Lk, D, Dv)
    mask: dict[str, Any] = field(default_factory=dict)
    softcap: float | None = None

    def scaled(self, factor: int) -> Case:
        """The same case with sequence lengths divided by ``factor`` (CPU runs)."""
        b, hq, hkv, lq, lk, d, dv = self.dims
        mask = dict(self.mask)
        for name in ("key_lengths", "query_lengths"):
            if name in mask:
                mask[name] = [max(0, n // factor) for n in mask[name]]
        if "window" in mask:
            mask["window"] = tuple(None if w is None else max(1, w // factor)
                                   for w in mask["window"])
        short = (lambda n: n) if lq <= 16 else (lambda n: max(1, n // factor))
        return Case(self.name, (b, hq, hkv, short(lq), max(1, lk // factor), d, dv),
                    mask, self.softcap)


CASES = [
    Case("full", (2, 4, 4, 1024, 1024, 128, 128)),
    Case("causal_bottom_right_cross", (1, 4, 4, 1500, 4096, 64, 64),
         {"causal": "bottom_right"}),
    Case("causal_top_left_long_queries", (2, 4, 4, 2500, 700, 128, 128),
         {"causal": "top_left"}),
    Case("causal_4096", (1, 4, 4, 4096, 4096, 128, 128), {"causal": "bottom_right"}),
    Case("window", (2, 4, 4, 2048, 2048, 64, 64), {"window": (256, 16)}),
    Case("lengths_causal", (3, 4, 2, 1000, 3000, 128, 128),
         {"causal": "bottom_right", "key_lengths": [3000, 1234, 0],
          "query_lengths": [1000, 999, 17]}),
    Case("gqa_32_8_causal", (1, 32, 8, 2048, 2048, 128, 128), {"causal": "bottom_right"}),
    Case("softcap", (1, 4, 4, 1024, 1024, 64, 64), {"causal": "top_left"}, softcap=30.0),
    Case("uneven_head_dims", (1, 4, 4, 1000, 1500, 80, 48), {"causal": "bottom_right"}),
    Case("decode_1", (4, 32, 8, 1, 32768, 128, 128), {"key_lengths": [32768, 30001, 1, 0]}),
    Case("decode_16_causal", (2, 16, 4, 16, 8192, 128, 128), {"causal": "bottom_right"}),
    Case("decode_16_window", (2, 8, 8, 16, 8192, 64, 64), {"window": (1000, 0)}),
]


def _mask(spec: dict[str, Any], lengths: Any) -> Any:
    from portattn import masks

    parts = []
    if "causal" in spec:
        parts.append(masks.causal(spec["causal"]))
    if "window" in spec:
        parts.append(masks.sliding_window(*spec["window"]))
    for name in ("key_lengths", "query_lengths"):
        if name in spec:
            parts.append(getattr(masks, name)(lengths(spec[name])))
    mask = None
    for part in parts:
        mask = part if mask is None else mask & part
    return mask


def poison_allocator(device: Any, nbytes: int) -> None:
    """Fill ``nbytes`` of torch's caching allocator with NaN and free them: outputs
    allocated next reuse that memory, so an element the kernel never writes is NaN."""
    import torch

    if torch.device(device).type != "cuda":
        return  # the CPU allocator returns memory to the system: nothing to poison
    block = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    block.fill_(float("nan"))
    del block


def inputs(case: Case, device: Any, seed: int = 0) -> tuple[Any, Any, Any]:
    """float64 query, key, value of ``case`` on ``device``."""
    import torch

    b, hq, hkv, lq, lk, d, dv = case.dims
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(b, h, n, e, device=device, dtype=torch.float64, generator=gen)
                 for h, n, e in ((hq, lq, d), (hkv, lk, d), (hkv, lk, dv)))


def run_case(case: Case, dtype: str, device: Any, namespace: str = "torch",
             tf32: bool = False) -> tuple[str, str, dict[str, Any]]:
    """``(status, detail, figures)`` of one case (status ``ok``, ``tf32`` or
    ``FAIL``)."""
    import torch

    from portattn import attention, explain
    from portattn.errors import KernelNotUsableError
    from portattn.testing.oracle import tolerance

    q64, k64, v64 = inputs(case, device)

    def lengths64(n: list[int]) -> Any:
        return torch.tensor(n, device=device)

    want_out, want_lse = attention(q64, k64, v64, mask=_mask(case.mask, lengths64),
                                   softcap=case.softcap, return_lse=True, kernel="reference")
    tensors = [t.to(getattr(torch, dtype)) for t in (q64, k64, v64)]
    convert, back, lengths, stream = _namespace(namespace, device)
    with stream:  # inputs made, the call run and the results read on the caller's stream
        args = [convert(t) for t in tensors]
        kwargs = {"mask": _mask(case.mask, lengths), "softcap": case.softcap,
                  "return_lse": True}
        plan = explain(*args, **kwargs)
        chosen = None if plan.kernel is None else plan.kernel.name
        if chosen != "triton_flash":
            return "FAIL", f"explain() chose {chosen}, not triton_flash:\n{plan}", {}
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        try:
            nbytes = 4 * 2 * math.prod(want_out.shape)
            poison_allocator(device, nbytes)
            # Forced: a NaN answer must fail here, not be recomputed by another kernel.
            out, lse = attention(*args, **kwargs, kernel="triton_flash")
            poison_allocator(device, nbytes)
            again_out, again_lse = attention(*args, **kwargs, kernel="triton_flash")
        except KernelNotUsableError as e:
            return "FAIL", f"triton_flash declined its own answer: {e}", {}
        finally:
            torch.set_float32_matmul_precision(previous)
        out, lse, again_out, again_lse = (back(x) for x in (out, lse, again_out, again_lse))
        torch.cuda.synchronize() if torch.device(device).type == "cuda" else None
    for what, got in (("out", out), ("lse", lse), ("out", again_out), ("lse", again_lse)):
        if torch.isnan(got).any():
            return "FAIL", f"{what}: NaN (an element left unwritten, or a NaN computed)", {}
    if not (torch.equal(out, again_out) and torch.equal(lse, again_lse)):
        return "FAIL", "a second run is not bitwise equal", {}
    rtol, atol = TF32_TOLERANCE if tf32 else tolerance(dtype)
    figures = {}
    for what, got, want in (("out", out, want_out), ("lse", lse, want_lse)):
        got = got.double()
        inf = torch.isinf(want)
        if not torch.equal(torch.isinf(got), inf) or not torch.equal(got[inf], want[inf]):
            return "FAIL", f"{what}: infinities differ from the reference", {}
        err = (got - want).abs().where(~inf, 0.0)
        excess = (err - (atol + rtol * want.abs().where(~inf, 0.0))).max().item()
        figures[f"{what}_max_abs_error"] = err.max().item()
        if excess > 0:
            return ("FAIL", f"{what}: max |error| {err.max().item():.3g} beyond "
                    f"rtol={rtol:g}, atol={atol:g}", figures)
    return ("tf32" if tf32 else "ok"), "", figures


def _namespace(name: str, device: Any) -> tuple[Any, Any, Any, Any]:
    """``(convert, back, lengths, stream context)`` for torch or CuPy inputs."""
    import contextlib

    import torch

    if name == "torch":
        return (lambda t: t), (lambda x: x), (lambda n: torch.tensor(n, device=device)), \
            contextlib.nullcontext()
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)  # not the default: DLPack must sync
    torch.cuda.synchronize()
    return (cupy.from_dlpack, torch.from_dlpack, lambda n: cupy.asarray(n, dtype=cupy.int64),
            stream)


def run(report: Any, device: Any, namespaces: list[str], scale: int = 1,
        dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32"),
        cases: list[Case] | None = None) -> None:
    """Every case x dtype x namespace into ``report`` (section ``accuracy``); float32
    twice, with three-TF32 products and with plain TF32."""
    for case in CASES if cases is None else cases:
        small = case.scaled(scale) if scale > 1 else case
        for namespace in namespaces:
            for dtype in dtypes:
                for tf32 in ((False, True) if dtype == "float32" else (False,)):
                    label = f"{small.name} {small.dims} {dtype}{' tf32' if tf32 else ''} " \
                            f"[{namespace}]"
                    if namespace == "cupy" and dtype == "bfloat16":
                        report.check("accuracy", label, "skip", "cupy has no bfloat16")
                        continue
                    try:
                        status, detail, figures = run_case(small, dtype, device, namespace,
                                                           tf32)
                    except Exception as e:  # any crash is a failed check, with its message
                        status, detail, figures = "FAIL", f"{type(e).__name__}: {e}", {}
                    report.check("accuracy", label, "ok" if status == "tf32" else status,
                                 detail, **figures)
