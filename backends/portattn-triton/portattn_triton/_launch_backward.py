"""Launching the backward kernels on torch tensors.

:func:`flash_backward` is the direct entry point, the counterpart of
:func:`~portattn_triton.flash_forward`: given the inputs, the forward's ``out`` and
``lse`` and the gradients of both, it returns ``(dq, dk, dv)``. Three launches:
``Delta`` per query row, then dK/dV per key block, then dQ per query block.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._configs import BackwardConfig, block_dim, delta_rows, is_even, pick_backward_config
from ._launch import Band, _lengths, _on_device, _precision, band, cut_keys, not_finite

if TYPE_CHECKING:
    import torch

__all__ = ["flash_backward"]

def flash_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor | None,
                   dlse: torch.Tensor | None = None, *, scale: float | None = None,
                   softcap: float | None = None, causal: str | None = None,
                   window: tuple[int | None, int | None] | None = None,
                   band_offsets: Band = (None, None),
                   key_lengths: torch.Tensor | None = None,
                   query_lengths: torch.Tensor | None = None,
                   config: BackwardConfig | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`flash_forward`'s ``(out, lse)`` for ``query``, ``key`` and
    ``value``, given ``dout`` and ``dlse`` (None: zero). Mask arguments as for the
    forward; ``config`` fixes the block sizes instead of the table's. Deterministic:
    no atomics, the same inputs give bitwise the same gradients."""
    import torch

    *batch, hq, lq, d = query.shape
    hkv, lk, dv = key.shape[-3], key.shape[-2], value.shape[-1]
    z = math.prod(batch)
    # Every element is written by the kernels (zeros where no query sees a key).
    empty = z == 0 or hq == 0 or lq == 0 or lk == 0 or (dout is None and dlse is None)
    new = torch.zeros_like if empty else torch.empty_like
    dq, dk, dvalue = (new(t, memory_format=torch.contiguous_format)
                      for t in (query, key, value))
    if empty:
        return dq, dk, dvalue
    dev = query.device
    if dout is None:
        dout = torch.zeros_like(out)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lower, upper = band(lq, lk, causal, window, band_offsets)
    if config is None:
        capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
        config = pick_backward_config(capability, query.element_size(), d, dv)

    q = query.reshape(z, hq, lq, d)
    k = key.reshape(z, hkv, lk, d)
    v = value.reshape(z, hkv, lk, dv)
    o = out.reshape(z, hq, lq, dv)
    do = dout.to(query.dtype).reshape(z, hq, lq, dv)
    lse_rows = lse.reshape(z * hq, lq).float().contiguous()
    dlse_rows = None if dlse is None else dlse.reshape(z * hq, lq).float().contiguous()
    delta = torch.empty((z * hq, lq), dtype=torch.float32, device=dev)
    g_q, g_k, g_v = (g.view(z, n, length, e) for g, n, length, e in
                     ((dq, hq, lq, d), (dk, hkv, lk, d), (dvalue, hkv, lk, dv)))
    kl = _lengths(key_lengths, z)
    ql = _lengths(query_lengths, z)
    # The kernels read whole tiles, keys and queries past the lengths included: their
    # weight is 0, but a NaN there would reach the gradients as 0 * NaN. Bounding the
    # loads costs the dK/dV and dQ passes registers they do not have (ptxas spills at
    # sm_90), so those rows are zeroed here, in one pass over the inputs.
    if kl is not None:
        k, v = _zero_past(k, kl), _zero_past(v, kl)
    if ql is not None:
        q, do = _zero_past(q, ql), _zero_past(do, ql)
    # For the same reason, keys the band cuts whose key or value is not finite are
    # zeroed too, and the rows that attend them get a NaN lse: their gradients are NaN,
    # as the chain rule makes them through a non-finite key or value.
    cut = cut_keys(lower, upper, lq, lk)
    if cut is not None:
        bad = (not_finite(k, *cut) + not_finite(v, *cut)).isnan()
        k, v = k.masked_fill(bad[..., None], 0), v.masked_fill(bad[..., None], 0)
        lse_rows = _nan_where_met(lse_rows, bad, lower, upper, hq // hkv, lq)
    dummy = lse_rows  # stands in for absent optional tensors; never read
    flags = {
        "BLOCK_D": block_dim(d), "BLOCK_DV": block_dim(dv), "EVEN_D": is_even(d, dv),
        "HAS_LOWER": lower is not None, "HAS_UPPER": upper is not None,
        "HAS_KEY_LENGTHS": kl is not None, "HAS_QUERY_LENGTHS": ql is not None,
        "SOFTCAP": softcap is not None, "INPUT_PRECISION": _precision(query.dtype),
    }
    scalars = (d, dv, scale, 1.0 if softcap is None else float(softcap),
               0 if lower is None else lower, 0 if upper is None else upper)
    lengths = (dummy if kl is None else kl, dummy if ql is None else ql)

    from ._triton_backward import delta_kernel, dkdv_kernel
    from ._triton_dq import dq_kernel

    with _on_device(dev):
        rows = delta_rows(dv)
        delta_kernel[(z * hq, math.ceil(lq / rows))](
            o, do, lse_rows, dummy if dlse_rows is None else dlse_rows, delta,
            *o.stride(), *do.stride(), hq, lq, dv,
            BLOCK_M=rows, BLOCK_DV=block_dim(dv), HAS_DLSE=dlse_rows is not None,
            num_warps=4)
        c = config.dkdv
        dkdv_kernel[(z * hkv, math.ceil(lk / c.block_n))](
            q, k, v, do, lse_rows, delta, g_k, g_v, *lengths,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *g_k.stride(),
            *g_v.stride(), hkv, hq // hkv, lq, lk, *scalars,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, **flags,
            REVERSE=lower is not None and upper is None,
            num_warps=c.num_warps, num_stages=c.num_stages)
        c = config.dq
        dq_kernel[(z * hq, math.ceil(lq / c.block_m))](
            q, k, v, do, lse_rows, delta, g_q, *lengths,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *g_q.stride(),
            hq, hq // hkv, lq, lk, *scalars,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, **flags,
            REVERSE=upper is not None and lower is None,
            num_warps=c.num_warps, num_stages=c.num_stages)
    return dq, dk, dvalue


def _zero_past(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``x (Z, H, L, E)`` with the rows at or past each batch element's length zeroed."""
    import torch

    past = torch.arange(x.shape[-2], device=x.device) >= lengths.view(-1, 1, 1, 1)
    return x.masked_fill(past.view(-1, 1, x.shape[-2], 1), 0)


def _nan_where_met(lse: torch.Tensor, bad: torch.Tensor, lower: int | None,
                   upper: int | None, group: int, q_len: int) -> torch.Tensor:
    """``lse (Z * Hq, Lq)`` with NaN on the rows whose band holds a ``bad (Z, Hkv, Lk)``
    key; rows with no key at all (lse ``-inf``) keep theirs."""
    import torch

    kv_len = bad.shape[-1]
    before = torch.nn.functional.pad(bad.cumsum(-1), (1, 0))  # bad keys before each j
    i = torch.arange(q_len, device=bad.device)
    lo = torch.zeros_like(i) if lower is None else (i + lower).clamp(0, kv_len)
    hi = torch.full_like(i, kv_len) if upper is None else (i + upper + 1).clamp(0, kv_len)
    met = before[..., torch.maximum(hi, lo)] - before[..., lo] > 0  # (Z, Hkv, Lq)
    met = met.repeat_interleave(group, dim=1).reshape(lse.shape)
    return lse.masked_fill(met & (lse != -math.inf), math.nan)
