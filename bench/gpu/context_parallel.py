"""The GPU check's ``context_parallel`` section: :mod:`portattn.distributed` on CUDA
tensors against one float64 call of the whole sequence, forward and gradients (query,
key, value, and through the log-sum-exp), each error relative to the largest reference
entry (at least 1) and within the conformance kit's tolerance for the dtype.

One GPU machine holds one GPU, and torch.distributed cannot put two ranks on it: NCCL
refuses two ranks on one device, and gloo has no point-to-point sends of CUDA tensors.
So the section runs

- ``nccl``: the torch.distributed engine (its autograd function, its collectives) over
  an NCCL group of one rank, for every strategy (gloo on ``--device cpu``);
- ``threads``: 2 and 4 ranks as threads of one process
  (:class:`~portattn.distributed.LocalGroup`), every tensor on the GPU, the ring and
  the all-gather, forward and the portable backward (:func:`distributed.gradients`):
  the same schedule and per-pair kernels the processes run.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from report import Report

#: Positions of every case (64 head dims, one batch element).
LENGTH = 4096
#: float32 matmuls on the GPU may round as TF32 (10-bit mantissa).
TF32_TOLERANCE = 5e-3


def _cases() -> list[tuple[str, Any, int, int, str, str]]:
    """``(name, mask, hq, hkv, layout, strategy)``."""
    from portattn import masks

    return [("causal_gqa", masks.causal(), 8, 2, "zigzag", "ring"),
            ("window", masks.sliding_window(700, 0), 4, 4, "contiguous", "all_gather"),
            ("causal_ulysses", masks.causal(), 8, 4, "zigzag", "ulysses")]


def _data(length: int, hq: int, hkv: int, device: str) -> list[Any]:
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    shapes = ((hq, length, 64), (hkv, length, 64), (hkv, length, 64), (hq, length, 64),
              (hq, length))
    return [torch.randn(1, *s, device=device, dtype=torch.float64, generator=gen)
            for s in shapes]


def _reference(q: Any, k: Any, v: Any, dout: Any, dlse: Any, mask: Any) -> list[Any]:
    """``[out, lse, dq, dk, dv]`` of one float64 call of the whole sequence."""
    import torch

    from portattn import attention

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, mask=mask, return_lse=True, kernel="reference")
    grads = torch.autograd.grad([out, lse], leaves,
                                [dout, torch.where(torch.isinf(lse), 0.0, dlse)])
    return [out.detach(), lse.detach(), *grads]


def _verdict(got: list[Any], want: list[Any], dtype: str) -> tuple[str, str, dict]:
    """``(status, detail, errors)``: the relative error of each result."""
    import torch

    from portattn.testing.oracle import tolerance

    names = ("out", "lse", "dq", "dk", "dv")
    errors = {}
    for name, g, w in zip(names, got, want, strict=True):
        if torch.isnan(g).any():
            return "FAIL", f"NaN in {name}", errors
        finite = torch.isfinite(w)
        if not torch.equal(torch.isfinite(g), finite):
            return "FAIL", f"{name}: infinities differ from the reference", errors
        diff = (g.double()[finite] - w[finite]).abs().max()
        errors[name] = (diff / w[finite].abs().max().clamp(min=1)).item()
    worst = max(errors.values())
    detail = ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
    if worst <= tolerance(dtype)[1]:
        return "ok", detail, errors
    if dtype == "float32" and worst <= TF32_TOLERANCE:
        return "tf32", f"{detail}; within TF32 tolerance only", errors
    return "FAIL", f"{detail}; worst {worst:.2e} > {tolerance(dtype)[1]:g}", errors


def _threads(size: int, data: list[Any], mask: Any, layout: str, strategy: str,
             dtype: Any, interpreted: bool) -> list[Any]:
    """``[out, lse, dq, dk, dv]`` of the whole sequence from ``size`` thread ranks.
    ``interpreted``: Triton's interpreter (``--device cpu``) runs one kernel at a time,
    so the ranks' threads leave triton_flash to the other kernels."""
    import contextlib

    from portattn import disable_kernels, distributed

    q, k, v, dout, dlse = data
    n = q.shape[-2]

    def rank_work(group: Any) -> list[Any]:
        with disable_kernels("triton_flash") if interpreted else contextlib.nullcontext():
            return ranked(group)

    def ranked(group: Any) -> list[Any]:
        def cut(x: Any) -> Any:
            return distributed.shard(x, group, layout=layout)

        shards = [cut(x).to(dtype) for x in (q, k, v)]
        out, lse = distributed.attention(*shards, group=group, mask=mask, layout=layout,
                                         strategy=strategy, query_length=n, key_length=n,
                                         return_lse=True)
        prob = distributed.problem(*shards, rank=group.rank, size=group.size, mask=mask,
                                   layout=layout, query_length=n, key_length=n)
        grads = distributed.gradients(group, prob, *shards, out, lse, cut(dout).to(dtype),
                                      cut(dlse[..., None])[..., 0].float(),
                                      strategy=strategy)
        whole = [distributed.unshard(out, group, length=n, layout=layout),
                 distributed.unshard(lse[..., None], group, length=n, layout=layout)[..., 0]]
        return whole + [distributed.unshard(g, group, length=n, layout=layout)
                        for g in grads]

    return distributed.run_local(rank_work, size)[0]


def _engine(data: list[Any], mask: Any, layout: str, strategy: str, dtype: Any) -> list[Any]:
    """``[out, lse, dq, dk, dv]`` through the torch.distributed engine (one rank) and
    torch autograd."""
    import torch

    from portattn import distributed

    q, k, v, dout, dlse = data
    n = q.shape[-2]
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = distributed.attention(*leaves, group=None, mask=mask, layout=layout,
                                     strategy=strategy, query_length=n, key_length=n,
                                     return_lse=True)
    g_lse = torch.where(torch.isinf(lse), 0.0, dlse.to(lse.dtype))
    grads = torch.autograd.grad([out, lse], leaves, [dout.to(out.dtype), g_lse])
    return [out.detach(), lse.detach(), *grads]


def _check(report: Report, what: str, dtype: str, want: list[Any], compute: Any,
           *args: Any) -> None:
    """One check: ``compute(*args)`` against ``want``, its errors and seconds as
    figures."""
    import time

    started = time.perf_counter()
    errors: dict = {}
    try:
        status, detail, errors = _verdict(compute(*args), want, dtype)
    except Exception as e:  # a case that crashes is a failure, never a pass
        status, detail = "FAIL", f"{type(e).__name__}: {e}"
    report.check("context_parallel", what, status, detail, errors=errors,
                 seconds=round(time.perf_counter() - started, 2))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(report: Report, device: str, scale: int = 1, chosen: set | None = None) -> None:
    """The section's cases (those named in ``chosen``; None: all) into ``report``
    (``scale`` divides the length)."""
    import torch
    import torch.distributed as dist

    cases = [c for c in _cases() if chosen is None or c[0] in chosen]
    if not cases:
        return
    length = max(64, LENGTH // scale)
    dtypes = ("bfloat16", "float32")
    for name, mask, hq, hkv, layout, strategy in cases:
        data = _data(length, hq, hkv, device)
        want = _reference(*data, mask)
        report.figure("context_parallel", case=name, length=length, heads=hq,
                      kv_heads=hkv, head_dim=64, layout=layout, strategy=strategy)
        for dtype in dtypes:
            if strategy != "ulysses":  # ulysses' gradients need the library's autograd
                for size in (2, 4):
                    what = f"threads {size} ranks {strategy} {layout} {dtype} {name}"
                    _check(report, what, dtype, want, _threads, size, data, mask, layout,
                           strategy, getattr(torch, dtype), device == "cpu")
    backend = "nccl" if device == "cuda" else "gloo"
    from importlib.util import find_spec

    if find_spec("portattn_torch") is None:  # the engine comes with portattn-torch
        report.check("context_parallel", f"{backend} 1 rank engine", "skip",
                     "portattn-torch is not installed")
        return
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
    except Exception as e:
        report.check("context_parallel", f"{backend} init", "FAIL", f"{type(e).__name__}: {e}")
        return
    try:
        for name, mask, hq, hkv, layout, strategy in cases:
            data = _data(length, hq, hkv, device)
            want = _reference(*data, mask)
            for dtype in dtypes:
                what = f"{backend} 1 rank {strategy} {layout} {dtype} {name}"
                _check(report, what, dtype, want, _engine, data, mask, layout, strategy,
                       getattr(torch, dtype))
    finally:
        dist.destroy_process_group()
