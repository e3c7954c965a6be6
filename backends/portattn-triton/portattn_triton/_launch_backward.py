"""Launching the backward kernels on torch tensors.

:func:`flash_backward` is the direct entry point, the counterpart of
:func:`~portattn_triton.flash_forward`: given the inputs, the forward's ``out`` and
``lse`` and the gradients of both, it returns ``(dq, dk, dv)`` (and the bias gradient
when asked). Three launches: ``Delta`` per query row, then dK/dV per key block, then dQ
per query block, each pass reading the block form on its own grid.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._configs import (
    BackwardConfig,
    backward_extra,
    block_dim,
    delta_rows,
    is_even,
    pick_backward_config,
)
from ._distance import check_tiles, distance_gradient, gradient_buffer
from ._launching import bias_strides, check_shapes, on_device, precision, tables
from ._plan import MaskPlan, plan_for
from ._poison import not_finite

if TYPE_CHECKING:
    import torch

    from portattn.masks import Mask

    from ._triton_dropout import Dropout

__all__ = ["backward", "flash_backward"]


def flash_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor | None,
                   dlse: torch.Tensor | None = None, *, scale: float | None = None,
                   softcap: float | None = None, mask: Mask | None = None,
                   causal: str | None = None,
                   window: tuple[int | None, int | None] | None = None,
                   key_lengths: torch.Tensor | None = None,
                   query_lengths: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, bias_grad: bool = False,
                   config: BackwardConfig | None = None) -> tuple[torch.Tensor, ...]:
    """Gradients of :func:`flash_forward`'s ``(out, lse)`` for ``query``, ``key`` and
    ``value``, given ``dout`` and ``dlse`` (None: zero), and with ``bias_grad`` for
    ``bias`` too (a fourth result, in the bias's shape and dtype). Mask and bias
    arguments as for the forward; ``config`` fixes the block sizes instead of the
    table's. Deterministic: no atomics, the same inputs give bitwise the same
    gradients."""
    check_shapes(query, key, value)
    if bias_grad and bias is None:
        msg = "bias_grad=True needs a bias"
        raise ValueError(msg)
    plan = plan_for(query, key, mask=mask, causal=causal, window=window,
                    key_lengths=key_lengths, query_lengths=query_lengths, bias=bias)
    dq, dk, dv, dbias, _ = backward(query, key, value, out, lse, dout, dlse, plan,
                                    scale=scale, softcap=softcap, config=config,
                                    bias_like=bias if bias_grad else None)
    return (dq, dk, dv, dbias) if bias_grad else (dq, dk, dv)


def backward(query: Any, key: Any, value: Any, out: Any, lse: Any, dout: Any, dlse: Any,
             plan: MaskPlan, *, scale: float | None, softcap: float | None,
             config: BackwardConfig | None = None, bias_like: Any = None,
             dropout: Dropout | None = None, distance_grad: bool = False) -> tuple[Any, ...]:
    """``(dq, dk, dv, dbias, ddistance)`` with the mask and bias already planned;
    ``dbias`` (None unless ``bias_like``, the bias to give the gradient of, is passed)
    is shaped like it; ``ddistance`` (None unless ``distance_grad``) is the gradient of
    ``plan.distance``'s ``(Hq, Lq + Lk - 1)`` array, float32 (None too for an empty
    call: zero). ``dropout``: the forward's, whose pairs the passes draw again."""
    import torch

    *batch, hq, lq, d = query.shape
    hkv, lk, dv = key.shape[-3], key.shape[-2], value.shape[-1]
    z = math.prod(batch)
    # Every element is written by the kernels (zeros where no query sees a key).
    empty = z == 0 or hq == 0 or lq == 0 or lk == 0 or (dout is None and dlse is None)
    new = torch.zeros_like if empty else torch.empty_like
    dq, dk, dvalue = (new(t, memory_format=torch.contiguous_format)
                      for t in (query, key, value))
    dbias_full = None
    if bias_like is not None:  # written where the tiles are visited, 0 elsewhere
        dbias_full = torch.zeros((z, hq, lq, lk), dtype=torch.float32, device=query.device)
    if empty:
        return (dq, dk, dvalue, None if bias_like is None else torch.zeros_like(bias_like),
                None)
    dev = query.device
    if dout is None:
        dout = torch.zeros_like(out)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lower, upper = plan.band
    if config is None:
        capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
        config = pick_backward_config(capability, query.element_size(), d, dv, extra=(
            "dropout" if dropout is not None else backward_extra(plan.extra)))
    if plan.distance is not None:
        check_tiles(config.dkdv.block_m, config.dkdv.block_n, config.dq.block_m,
                    config.dq.block_n)

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
    kl, ql = plan.key_lengths, plan.query_lengths
    # The kernels read whole tiles, keys and queries past the lengths included: their
    # weight is 0, but a NaN there would reach the gradients as 0 * NaN. Bounding the
    # loads costs the dK/dV and dQ passes registers they do not have (ptxas spills at
    # sm_90), so those rows are zeroed here, in one pass over the inputs.
    if kl is not None:
        k, v = _zero_past(k, kl), _zero_past(v, kl)
    if ql is not None:
        q, do = _zero_past(q, ql), _zero_past(do, ql)
    # For the same reason, keys a visited tile may hide whose key or value is not finite
    # are zeroed too, and the rows that attend them get NaN gradients, as the chain rule
    # through them makes them: under the band alone, through a NaN lse on the rows whose
    # band holds such a key (nothing added to the kernels' loops); with a table, through
    # ``bad`` (NaN on those keys), which joins the scores of the rows that attend them.
    bad = None
    if plan.cut is not None:
        bad = not_finite(k, plan.cut) + not_finite(v, plan.cut)
        hidden = bad.isnan()[..., None]
        k, v = k.masked_fill(hidden, 0), v.masked_fill(hidden, 0)
        if not plan.needs_table:
            lse_rows = _nan_where_met(lse_rows, bad.isnan(), lower, upper, hq // hkv, lq)
            bad = None
    dummy = lse_rows  # stands in for absent optional tensors; never read
    bias = plan.bias
    flags = {
        "BLOCK_D": block_dim(d), "BLOCK_DV": block_dim(dv), "EVEN_D": is_even(d, dv),
        "HAS_LOWER": lower is not None, "HAS_UPPER": upper is not None,
        "HAS_KEY_LENGTHS": kl is not None, "HAS_QUERY_LENGTHS": ql is not None,
        "HAS_BAD": bad is not None, "HAS_BIAS": bias is not None,
        "HAS_DISTANCE": plan.distance is not None,
        "HAS_TABLE": plan.needs_table, "SOFTCAP": softcap is not None,
        "INPUT_PRECISION": precision(query.dtype),
    }
    scalars = (d, dv, scale, 1.0 if softcap is None else float(softcap),
               0 if lower is None else lower, 0 if upper is None else upper,
               *((dummy, 0, 1.0) if dropout is None else dropout.arguments()))
    flags["DROPOUT"] = dropout is not None
    shared = (*(dummy if t is None else t for t in (kl, ql, bad)),)
    distance = dummy if plan.distance is None else plan.distance.values
    wants_distance = distance_grad and plan.distance is not None

    from ._triton_backward import delta_kernel, dkdv_kernel
    from ._triton_dq import dq_kernel

    with on_device(dev):
        rows = delta_rows(dv)
        delta_kernel[(z * hq, math.ceil(lq / rows))](
            o, do, lse_rows, dummy if dlse_rows is None else dlse_rows, delta,
            *o.stride(), *do.stride(), hq, lq, dv,
            BLOCK_M=rows, BLOCK_DV=block_dim(dv), HAS_DLSE=dlse_rows is not None,
            num_warps=4)
        c = config.dkdv
        table, table_args, bits, has_bits = tables(plan, c.block_m, c.block_n, dummy,
                                                   columns=True)
        dkdv_kernel[(z * hkv, math.ceil(lk / c.block_n))](
            q, k, v, do, lse_rows, delta, g_k, g_v, *shared, table, bits,
            dummy if bias is None else bias, distance,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *g_k.stride(),
            *g_v.stride(), *bias_strides(bias), *table_args, hkv, hq // hkv, lq, lk,
            *scalars, BLOCK_M=c.block_m, BLOCK_N=c.block_n, **flags,
            HAS_BITS=has_bits, REVERSE=lower is not None and upper is None,
            num_warps=c.num_warps, num_stages=c.num_stages)
        c = config.dq
        table, table_args, bits, has_bits = tables(plan, c.block_m, c.block_n, dummy)
        slices = (gradient_buffer(z * hq, lq, lk, c.block_m, c.block_n, dev)
                  if wants_distance else None)
        dq_kernel[(z * hq, math.ceil(lq / c.block_m))](
            q, k, v, do, lse_rows, delta, g_q, *shared, table, bits,
            dummy if bias is None else bias, dummy if dbias_full is None else dbias_full,
            distance, dummy if slices is None else slices,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *g_q.stride(),
            *bias_strides(bias), *table_args, hq, hq // hkv, lq, lk, *scalars,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, **flags, HAS_BITS=has_bits,
            BIAS_GRAD=dbias_full is not None, DISTANCE_GRAD=wants_distance,
            REVERSE=upper is not None and lower is None,
            num_warps=c.num_warps, num_stages=c.num_stages)
    dbias = None
    if dbias_full is not None:
        dbias = reduce_to(dbias_full.view(*batch, hq, lq, lk), tuple(bias_like.shape))
        dbias = dbias.to(bias_like.dtype)
    ddistance = None if slices is None else distance_gradient(slices, hq, lq, lk,
                                                               config.dq.block_m)
    return dq, dk, dvalue, dbias, ddistance


def reduce_to(grad: Any, shape: tuple[int, ...]) -> Any:
    """``grad`` of a broadcast result summed back to the ``shape`` broadcast from."""
    full = (1,) * (grad.ndim - len(shape)) + shape
    axes = [i for i, (n, m) in enumerate(zip(full, grad.shape, strict=True)) if n == 1 and m != 1]
    if axes:
        grad = grad.sum(dim=axes, keepdim=True)
    return grad.reshape(shape)


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


def _zero_past(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``x (Z, H, L, E)`` with the rows at or past each batch element's length zeroed."""
    import torch

    past = torch.arange(x.shape[-2], device=x.device) >= lengths.view(-1, 1, 1, 1)
    return x.masked_fill(past.view(-1, 1, x.shape[-2], 1), 0)
