"""Large-size accuracy: triton_flash through dispatch against the float64 reference.

Sizes cross many query blocks and key tiles (L up to 4096, Lq != Lk), the band and
length masks, masks read from bit tiles (packed documents, a window with global
tokens, a window with attention sinks), a float32 bias, grouped-query heads, softcap,
the lse, uneven head dims, and decode shapes (few queries, long keys). Each case:
``explain()`` must choose triton_flash; the caching allocator is filled with NaN
first, so any output element the kernel fails to write shows; a second run must be
bitwise equal; out and lse are compared with the ``reference`` kernel in float64
within the dtype's tolerance (float32: the float32 tolerance with three-TF32
products, the TF32 one with ``set_float32_matmul_precision("high")``). CuPy arrays go
through DLPack on a non-default CuPy stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: (rtol, atol) for float32 results computed with plain TF32 matmuls (10-bit mantissa).
TF32_TOLERANCE = (5e-3, 5e-3)


@dataclass(frozen=True)
class Case:
    """``mask`` holds parts combined with ``&``: ``causal`` (alignment), ``window``
    (left, right), ``key_lengths``/``query_lengths`` (per batch element),
    ``documents`` (document lengths packed from key 0; the queries are the last Lq
    positions), ``window_global`` (w, positions): ``sliding_window(w, w) |
    global_tokens(positions)``, ``window_sinks`` (w, n): ``sliding_window(w) |
    sink_tokens(n)``. ``bias``: ``"heads"`` adds a float32 ``(Hq, Lq, Lk)`` bias."""

    name: str
    dims: tuple[int, ...]  # (B, Hq, Hkv, Lq, Lk, D, Dv)
    mask: dict[str, Any] = field(default_factory=dict)
    softcap: float | None = None
    bias: str | None = None

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
        if "documents" in mask:  # still packed to the end when they were
            sizes = [max(1, n // factor) for n in mask["documents"]]
            if sum(mask["documents"]) == lk:
                sizes[-1] += max(1, lk // factor) - sum(sizes)
            mask["documents"] = sizes
        if "window_global" in mask:
            w, positions = mask["window_global"]
            mask["window_global"] = (max(1, w // factor), [p // factor for p in positions])
        if "window_sinks" in mask:
            w, sinks = mask["window_sinks"]
            mask["window_sinks"] = (max(1, w // factor), sinks)
        short = (lambda n: n) if lq <= 16 else (lambda n: max(1, n // factor))
        return Case(self.name, (b, hq, hkv, short(lq), max(1, lk // factor), d, dv),
                    mask, self.softcap, self.bias)


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
    # masks read from bit tiles, and a bias
    Case("documents_causal", (2, 8, 4, 4096, 4096, 128, 128),
         {"causal": "bottom_right", "documents": [1000, 37, 2059, 500, 300, 200]}),
    Case("window_global", (1, 8, 8, 4096, 4096, 64, 64),
         {"window_global": (256, [0, 1, 2048, 4000])}),
    Case("causal_window_sinks", (1, 8, 2, 4096, 4096, 128, 128),
         {"causal": "bottom_right", "window_sinks": (1000, 4)}),
    Case("bias_causal_cross", (2, 4, 4, 1024, 1500, 64, 64), {"causal": "bottom_right"},
         bias="heads"),
    Case("decode_documents", (2, 32, 8, 1, 8192, 128, 128), {"documents": [3000, 5192]}),
]


def _mask(spec: dict[str, Any], array: Any, q_len: int, kv_len: int) -> Any:
    """The mask of ``spec`` (see :class:`Case`); ``array`` makes an integer array of a
    list on the device, in the call's library."""
    from portattn import masks

    parts = []
    if "causal" in spec:
        parts.append(masks.causal(spec["causal"]))
    if "window" in spec:
        parts.append(masks.sliding_window(*spec["window"]))
    for name in ("key_lengths", "query_lengths"):
        if name in spec:
            parts.append(getattr(masks, name)(array(spec[name])))
    if "documents" in spec:
        ids = [i for i, n in enumerate(spec["documents"]) for _ in range(n)][:kv_len]
        ids += [-1] * (kv_len - len(ids))
        parts.append(masks.documents(array(ids[kv_len - q_len:]), array(ids)))
    if "window_global" in spec:
        w, positions = spec["window_global"]
        parts.append(masks.sliding_window(w, w) | masks.global_tokens(array(positions)))
    if "window_sinks" in spec:
        w, sinks = spec["window_sinks"]
        parts.append(masks.sliding_window(w) | masks.sink_tokens(sinks))
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


def inputs(case: Case, device: Any, seed: int = 0) -> tuple[Any, ...]:
    """float64 query, key, value and bias (None without one) of ``case`` on ``device``
    (the bias's values are float32's)."""
    import torch

    b, hq, hkv, lq, lk, d, dv = case.dims
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, e, device=device, dtype=torch.float64, generator=gen)
               for h, n, e in ((hq, lq, d), (hkv, lk, d), (hkv, lk, dv)))
    bias = None
    if case.bias == "heads":
        bias = torch.randn(hq, lq, lk, device=device, dtype=torch.float32, generator=gen)
        bias = bias.double()
    return q, k, v, bias


def run_case(case: Case, dtype: str, device: Any, namespace: str = "torch",
             tf32: bool = False) -> tuple[str, str, dict[str, Any]]:
    """``(status, detail, figures)`` of one case (status ``ok``, ``tf32`` or
    ``FAIL``)."""
    import torch

    from portattn import attention, explain
    from portattn.errors import KernelNotUsableError
    from portattn.testing.oracle import tolerance

    q64, k64, v64, bias64 = inputs(case, device)
    lq, lk = case.dims[3], case.dims[4]

    def array64(n: list[int]) -> Any:
        return torch.tensor(n, device=device)

    want_out, want_lse = attention(q64, k64, v64, mask=_mask(case.mask, array64, lq, lk),
                                   bias=bias64, softcap=case.softcap, return_lse=True,
                                   kernel="reference")
    tensors = [t.to(getattr(torch, dtype)) for t in (q64, k64, v64)]
    convert, back, array, stream = _namespace(namespace, device)
    with stream:  # inputs made, the call run and the results read on the caller's stream
        args = [convert(t) for t in tensors]
        kwargs = {"mask": _mask(case.mask, array, lq, lk), "softcap": case.softcap,
                  "return_lse": True,  # a float32 bias, whatever the inputs' dtype
                  "bias": None if bias64 is None else convert(bias64.float())}
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
    """``(convert, back, array, stream context)`` for torch or CuPy inputs (``array``:
    an integer array of a list, on the device)."""
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
        cases: list[Case] | None = None, tf32: bool = True) -> None:
    """Every case x dtype x namespace into ``report`` (section ``accuracy``); float32
    twice, with three-TF32 products and (``tf32``) with plain TF32."""
    for case in CASES if cases is None else cases:
        small = case.scaled(scale) if scale > 1 else case
        for namespace in namespaces:
            for dtype in dtypes:
                for plain in ((False, True) if dtype == "float32" and tf32 else (False,)):
                    label = f"{small.name} {small.dims} {dtype}{' tf32' if plain else ''} " \
                            f"[{namespace}]"
                    if namespace == "cupy" and dtype == "bfloat16":
                        report.check("accuracy", label, "skip", "cupy has no bfloat16")
                        continue
                    try:
                        status, detail, figures = run_case(small, dtype, device, namespace,
                                                           plain)
                    except Exception as e:  # any crash is a failed check, with its message
                        status, detail, figures = "FAIL", f"{type(e).__name__}: {e}", {}
                    report.check("accuracy", label, "ok" if status == "tf32" else status,
                                 detail, **figures)
