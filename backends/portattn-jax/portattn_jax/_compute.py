"""One attention call through ``jax.nn.dot_product_attention``, compiled per plan.

JAX takes ``(B, L, H, D)`` with one batch dim; portattn has ``(..., H, L, D)``. The
extra batch dims are flattened and the middle axes swapped on the way in and back on
the way out (XLA fuses the transposes into its dot products).

Three places where JAX's answer differs from portattn's are fixed here:

- a query row with no allowed key gets the uniform average of the values from JAX
  (it masks with a large finite number); portattn's answer is 0, so such rows are
  zeroed. Zeroing with ``where`` also gives them zero gradients, which is exact;
- NaN or inf in a key or value row a mask hides (padding beyond the key lengths, the
  future under a causal mask) would reach the output through ``0 * NaN``. So when
  the mask or bias can hide anything, every key row whose key or value is not finite
  is zeroed in both, and the rows the mask lets see one are multiplied by NaN
  afterwards: found by a prefix sum over the keys for bands and lengths (O(B * H *
  (Lq + Lk))), from the boolean mask with a dense mask or a bias;
- ``-inf`` in the bias would give JAX ``NaN`` rows (softmax of ``-inf`` only). It is
  replaced by a finite number far below any score, which is exact for rows that keep
  a finite score and leaves rows without one to the zeroing above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from ._translate import Band

__all__ = ["Plan", "attend"]

#: Stands in for ``-inf`` in a bias: finite after adding any realistic score, and far
#: enough below one that ``exp`` of the difference is exactly 0 in float32.
_FAR_BELOW = float(jnp.finfo(jnp.float32).min) / 4


@dataclass(frozen=True)
class Plan:
    """The static part of one call (hashable: it keys the compilation cache)."""

    batch_shape: tuple[int, ...]
    scale: float
    implementation: str
    """``xla`` or ``cudnn``."""
    band: Band | None
    fix_rows: str
    """How rows without keys are found: ``none`` (there are none), ``band`` (from the
    band and the lengths, O(B * Lq)) or ``full`` (from the whole boolean mask, needed
    with a dense mask or a bias)."""


@partial(jax.jit, static_argnames=("plan",))
def attend(query: Any, key: Any, value: Any, bias: Any, dense: tuple[Any, ...],
           key_lengths: tuple[Any, ...], query_lengths: tuple[Any, ...], *,
           plan: Plan) -> Any:
    """Attention output ``(..., Hq, Lq, Dv)`` for portattn-layout inputs."""
    lq, lk = query.shape[-2], key.shape[-2]
    rank = query.ndim  # (*batch, H, Lq, Lk): every mask array is kept at this rank
    kl = _combined(jnp.minimum, key_lengths)
    ql = _combined(jnp.minimum, query_lengths)
    allowed = _combined(jnp.logical_and, dense)
    if bias is not None:
        bias = bias.astype(jnp.float32)
        finite = bias != -jnp.inf
        bias = jnp.where(finite, bias, _FAR_BELOW)
    else:
        finite = None
    seen = pairs = None
    if plan.band is not None or kl is not None or allowed is not None or bias is not None:
        # A hidden key gets weight 0, but 0 * NaN is NaN: the key rows that are not
        # finite are zeroed, and the rows the mask lets see one are made NaN below.
        key, value, bad = _clear_nonfinite(key, value)
        group = query.shape[-3] // key.shape[-3]
        if allowed is None and finite is None:
            seen = jnp.repeat(_seen_in_band(bad, plan.band, lq, kl), group, axis=-2)
        else:
            pairs = _pairs(plan.band, rank, lq, lk, kl, allowed, finite)
            seen = jnp.any(pairs & jnp.repeat(bad, group, axis=-2)[..., None, :], axis=-1)
    if plan.implementation == "xla":  # float32 there; GPUs would default to TF32
        with jax.default_matmul_precision("highest"):
            out = _call_jax(query, key, value, bias, allowed, kl, ql, plan)
    else:
        out = _call_jax(query, key, value, bias, allowed, kl, ql, plan)
    if seen is not None:  # times NaN, so that their gradients are NaN too
        out = out * jnp.where(seen, jnp.nan, 1.0).astype(out.dtype)[..., None]
    if plan.fix_rows == "none":
        return out
    if plan.fix_rows == "band":
        has_keys = _rows_from_band(plan.band, lq, lk, kl, ql)
    else:  # a dense mask or a bias: the pairs were built above
        has_keys = _rows_from_pairs(pairs, lq, ql)
    has_keys = jnp.reshape(has_keys, (1,) * (rank - 1 - has_keys.ndim) + has_keys.shape)
    return jnp.where(has_keys[..., None], out, jnp.zeros((), out.dtype))


def _combined(op: Any, arrays: tuple[Any, ...]) -> Any:
    if not arrays:
        return None
    result = arrays[0]
    for a in arrays[1:]:
        result = op(result, a)
    return result


def _call_jax(query, key, value, bias, allowed, kl, ql, plan):
    batch = plan.batch_shape
    flat = math.prod(batch)
    d, dv = query.shape[-1], value.shape[-1]
    q, k, v = (_to_jax_layout(a, flat) for a in (query, key, value))
    if plan.implementation == "xla" and q.dtype != jnp.float32:
        # Half precision: JAX's XLA path asks for a mixed-precision dot that CPUs reject
        # under jit, and rounds the weights to half before multiplying by V. float32
        # throughout is what portattn promises (accumulate in float32).
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    # JAX wants value.shape == key.shape; zero columns change no dot product.
    if dv < d:
        v = _pad_last(v, d)
    elif dv > d:
        q, k = _pad_last(q, dv), _pad_last(k, dv)
    kwargs: dict[str, Any] = {}
    if plan.implementation == "cudnn":
        kwargs["is_causal"] = plan.band is not None
        if plan.band is not None and plan.band.left is not None:
            kwargs["local_window_size"] = (plan.band.left, 0)
        if kl is not None:
            # Length 0 would leave cuDNN rows without keys (undefined there); those
            # rows are zeroed afterwards, so any length >= 1 gives the same answer.
            kwargs["key_value_seq_lengths"] = jnp.maximum(
                jnp.reshape(kl, (flat,)), 1).astype(jnp.int32)
    else:
        if plan.band is not None:
            kwargs["local_window_size"] = plan.band.window(q.shape[1], k.shape[1])
        if kl is not None:
            kwargs["key_value_seq_lengths"] = jnp.reshape(kl, (flat,)).astype(jnp.int32)
        if ql is not None:
            kwargs["query_seq_lengths"] = jnp.reshape(ql, (flat,)).astype(jnp.int32)
    out = jax.nn.dot_product_attention(
        q, k, v,
        bias=None if bias is None else _flatten_batch(bias, batch),
        mask=None if allowed is None else _flatten_batch(allowed, batch),
        scale=plan.scale, implementation=plan.implementation, **kwargs)
    out = out[..., :dv].astype(query.dtype)
    hq, length = query.shape[-3], query.shape[-2]
    return jnp.reshape(jnp.swapaxes(out, 1, 2), (*batch, hq, length, dv))


def _to_jax_layout(x: Any, flat: int) -> Any:
    """``(*batch, H, L, D) -> (B, L, H, D)``."""
    return jnp.swapaxes(jnp.reshape(x, (flat, *x.shape[-3:])), 1, 2)


def _pad_last(x: Any, size: int) -> Any:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _flatten_batch(x: Any, batch: tuple[int, ...]) -> Any:
    """A full-rank ``(*batch|1, H|1, Lq|1, Lk|1)`` array as ``(B|1, H|1, Lq|1, Lk|1)``."""
    lead, rest = x.shape[:len(batch)], x.shape[len(batch):]
    if all(s == 1 for s in lead):
        return jnp.reshape(x, (1, *rest))
    if lead != batch:  # broadcast over some batch dims only: JAX has one batch dim
        x = jnp.broadcast_to(x, (*batch, *rest))
    return jnp.reshape(x, (math.prod(batch), *rest))


def _clear_nonfinite(key: Any, value: Any) -> tuple[Any, Any, Any]:
    """``(key, value, bad)``: the key rows whose key or value is not finite zeroed in
    both, and ``bad`` ``(*batch, Hkv, Lk)`` marking them."""
    bad = ~(jnp.all(jnp.isfinite(key), axis=-1) & jnp.all(jnp.isfinite(value), axis=-1))
    key = jnp.where(bad[..., None], jnp.zeros((), key.dtype), key)
    value = jnp.where(bad[..., None], jnp.zeros((), value.dtype), value)
    return key, value, bad


def _seen_in_band(bad: Any, band: Band | None, lq: int, kl: Any) -> Any:
    """``(*batch, Hkv, Lq)``: does row ``i`` see a key ``bad`` marks? Row ``i`` sees
    keys ``max(0, i - left) <= j < min(n, i + right + 1)``; the marked ones among them
    are counted by a prefix sum, O(Lq + Lk) per head."""
    from ._translate import Band

    lk = bad.shape[-1]
    band = band or Band(None, None)
    i = jnp.reshape(jnp.arange(lq), (1,) * (bad.ndim - 1) + (lq,))  # (1, ..., 1, Lq)
    stop = jnp.full(i.shape, lk) if band.right is None else jnp.minimum(i + band.right + 1, lk)
    if kl is not None:
        stop = jnp.minimum(stop, kl[..., None, None])  # (*batch, 1, Lq)
    stop = jnp.clip(stop, 0, lk)
    start = jnp.zeros(i.shape, stop.dtype) if band.left is None else i - band.left
    start = jnp.clip(jnp.broadcast_to(start, stop.shape), 0, stop)
    before = jnp.pad(jnp.cumsum(bad, axis=-1), [(0, 0)] * (bad.ndim - 1) + [(1, 0)])
    shape = (*bad.shape[:-1], lq)
    count = (jnp.take_along_axis(before, jnp.broadcast_to(stop, shape), axis=-1)
             - jnp.take_along_axis(before, jnp.broadcast_to(start, shape), axis=-1))
    return count > 0


def _rows_from_band(band: Band | None, lq: int, lk: int, kl: Any, ql: Any) -> Any:
    """``(*batch|1, 1, Lq)``: does query row ``i`` keep a key? Without a score matrix.

    With key lengths ``n``, row ``i`` keeps ``max(0, i - left) <= min(lk, n, i + right + 1)
    - 1``: the band's rows, and also ``n >= 1`` and ``i - left < n``.
    """
    from ._translate import Band

    band = band or Band(None, None)
    start, stop = band.rows_with_keys(lq, lk)
    lengths = kl if kl is not None else ql
    i = jnp.reshape(jnp.arange(lq), (1,) * (0 if lengths is None else lengths.ndim) + (lq,))
    ok = (i >= start) & (i < stop)
    if kl is not None:
        n = kl[..., None]
        ok = ok & (n >= 1)
        if band.left is not None:
            ok = ok & (i - band.left < n)
    if ql is not None:
        ok = ok & (i < ql[..., None])
    return ok[..., None, :] if ok.ndim > 1 else ok


def _rows_from_pairs(pairs, lq, ql):
    """``(*batch|1, H|1, Lq)``: does row ``i`` keep a pair (bias ``-inf`` hiding) and lie
    below the query lengths?"""
    # A size-1 key axis stands for every key (Lk >= 1 here), so any() over it is right.
    rows = jnp.any(pairs, axis=-1)
    if ql is None:
        return rows
    i = jnp.reshape(jnp.arange(lq), (1,) * (rows.ndim - 1) + (lq,))
    return rows & (i < ql[..., None, None])


def _pairs(band, rank, lq, lk, kl, allowed, finite):
    """The pairs the mask allows, ``(*batch|1, H|1, Lq|1, Lk|1)`` (``rank`` dims), bias
    ``-inf`` hiding; query lengths aside."""
    lead = (1,) * (rank - 2)
    full = jnp.ones((*lead, 1, 1), dtype=bool)
    if band is not None:
        left, right = band.window(lq, lk)
        i = jnp.reshape(jnp.arange(lq), (*lead, lq, 1))
        j = jnp.reshape(jnp.arange(lk), (*lead, 1, lk))
        full = (j >= i - left) & (j <= i + right)
    if kl is not None:
        j = jnp.reshape(jnp.arange(lk), (*lead, 1, lk))
        full = full & (j < kl[..., None, None, None])
    if allowed is not None:
        full = full & allowed
    if finite is not None:
        full = full & finite
    return full
