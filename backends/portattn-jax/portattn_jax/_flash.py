"""FlashAttention-2 in ``lax`` loops, forward and backward, behind ``jax.custom_vjp``.

Forward: a ``scan`` over query blocks; for each, a ``fori_loop`` over the key blocks
it can reach (bounds traced from the band and the lengths, so skipped tiles cost
nothing) with an online softmax. Backward: a ``scan`` over key blocks accumulating dK
and dV, with a ``fori_loop`` over the query blocks that see the block; dQ (and dBias)
are loop carries updated in place. Each tile's probabilities are recomputed from the
saved log-sum-exp: memory is O(L * block), and no loop is unrolled under ``jit``.

Half precision computes in float32; float32/float64 in their own precision.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from ._flash_layout import (
    grouped_full,
    key_block_range,
    key_blocks,
    query_block_range,
    query_blocks,
    tile_allowed,
    tile_of,
    unblock_keys,
    unblock_queries,
    ungroup_full,
)

if TYPE_CHECKING:
    from ._flash_layout import FlashPlan

__all__ = ["backward", "flash_attention", "forward"]

_HIGHEST = lax.Precision.HIGHEST  # GPUs would otherwise multiply float32 in TF32


def compute_dtype(dtype: Any) -> Any:
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


def _mm(spec: str, a: Any, b: Any) -> Any:
    return jnp.einsum(spec, a, b, precision=_HIGHEST)


def _take(blocks: Any, i: Any) -> Any:
    return lax.dynamic_index_in_dim(blocks, i, 0, keepdims=False)


def _scores(plan: FlashPlan, qt: Any, kt: Any, bias: Any, allowed: Any,
            q0: Any, k0: Any) -> tuple[Any, Any]:
    """Masked scores of one tile and ``tanh`` of the soft-capped ones (or None).

    ``qt`` is already scaled, so ``qt @ kt^T`` are the scaled scores.
    """
    s = _mm("bhgqd,bhkd->bhgqk", qt, kt)
    t = None
    if plan.softcap is not None:
        t = jnp.tanh(s / plan.softcap)
        s = t * plan.softcap
    if bias is not None:
        s = s + tile_of(bias, plan, q0, k0)
    return jnp.where(allowed, s, -jnp.inf), t


def _padding_zeroed(x: Any, lengths: Any) -> Any:
    """Rows ``>= lengths[b]`` of ``(B, H, L, D)`` set to 0: a NaN or inf there would
    otherwise reach the result through ``0 * NaN`` in a product."""
    if lengths is None:
        return x
    keep = jnp.arange(x.shape[2])[None, :] < lengths[:, None]
    return jnp.where(keep[:, None, :, None], x, jnp.zeros((), x.dtype))


def _prepared(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, kl: Any, ql: Any,
              dense: Any) -> tuple:
    ct = compute_dtype(q.dtype)
    q = _padding_zeroed(q.astype(ct), ql)
    k, v = _padding_zeroed(k.astype(ct), kl), _padding_zeroed(v.astype(ct), kl)
    # A masked key has weight exactly 0, but 0 * NaN is NaN: the values are attended
    # with non-finite entries zeroed, and ``marks`` (1 for keys that held one) tells
    # which rows attend such a value (their output is NaN).
    finite = jnp.isfinite(v)
    marks = jnp.any(~finite, axis=-1, keepdims=True).astype(ct)
    v = jnp.where(finite, v, jnp.zeros((), ct))
    qb = query_blocks(q * jnp.asarray(plan.scale, ct), plan)
    kb, vb, mb = key_blocks(k, plan), key_blocks(v, plan), key_blocks(marks, plan)
    gbias = None if bias is None else grouped_full(bias.astype(ct), plan, 0)
    gdense = None if dense is None else grouped_full(dense, plan, False)
    return ct, qb, kb, vb, mb, gbias, gdense


def forward(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, kl: Any, ql: Any,
            dense: Any) -> tuple[Any, Any, Any]:
    """``(out, lse, tiles)``: out ``(B, Hq, Lq, Dv)`` and lse ``(B, Hq, Lq)`` in the
    compute dtype, and the number of tiles visited."""
    ct, qb, kb, vb, mb, gbias, gdense = _prepared(plan, q, k, v, bias, kl, ql, dense)
    _, b, hkv, g, bq, _ = qb.shape
    dv = v.shape[-1]

    def query_step(tiles, xs):
        iq, qt = xs
        q0 = iq * plan.block_q

        def key_step(ik, carry):
            acc, m, denom, seen, n = carry
            k0 = ik * plan.block_k
            allowed = tile_allowed(plan, q0, k0, kl, ql, gdense)
            s, _ = _scores(plan, qt, _take(kb, ik), gbias, allowed, q0, k0)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0, m_new)  # rows with no key yet
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            acc = acc * alpha[..., None] + _mm("bhgqk,bhke->bhgqe", p, _take(vb, ik))
            # rows whose scores do not hide a marked key (-inf), whatever its weight
            marked = _take(mb, ik)[..., 0][:, :, None, None, :] > 0
            seen = seen | jnp.any((s > -jnp.inf) & marked, axis=-1)
            return acc, m_new, denom * alpha + jnp.sum(p, axis=-1), seen, n + 1

        rows = (b, hkv, g, bq)
        init = (jnp.zeros((*rows, dv), ct), jnp.full(rows, -jnp.inf, ct),
                jnp.zeros(rows, ct), jnp.zeros(rows, bool), tiles)
        lo, hi = key_block_range(plan, iq, kl, ql)
        acc, m, denom, seen, tiles = lax.fori_loop(lo, hi, key_step, init)
        has_mass = denom > 0
        safe = jnp.where(has_mass, denom, 1)
        lse = jnp.where(has_mass, m + jnp.log(safe), -jnp.inf)
        out = jnp.where(seen[..., None], jnp.nan, acc / safe[..., None])
        return tiles, (out, lse)

    index = jnp.arange(plan.num_q_blocks, dtype=jnp.int32)
    tiles, (out, lse) = lax.scan(query_step, jnp.zeros((), jnp.int32), (index, qb))
    return unblock_queries(out, plan), unblock_queries(lse, plan), tiles


def backward(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, kl: Any, ql: Any,
             dense: Any, out: Any, lse: Any, dout: Any, dlse: Any,
             bias_grad: bool) -> tuple[Any, Any, Any, Any, Any]:
    """``(dq, dk, dv, dbias, tiles)`` in the compute dtype; ``dlse`` may be None, dbias
    is None unless ``bias_grad`` (then shaped like ``bias``)."""
    ct, qb, kb, vb, _, gbias, gdense = _prepared(plan, q, k, v, bias, kl, ql, dense)
    dout = dout.astype(ct)
    dob = query_blocks(dout, plan)
    delta = jnp.sum(dout * out.astype(ct), axis=-1)  # rowsum(dO * O)
    if dlse is not None:
        delta = delta - dlse.astype(ct)  # d lse / d s = P: ds = P * (dP - delta + dlse)
    deltab = query_blocks(delta, plan)
    # lse = -inf (no key) as +inf: exp(s - lse) is then exactly 0 on the whole row.
    lseb = query_blocks(jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(ct)), plan, jnp.inf)
    scale = jnp.asarray(plan.scale, ct)

    def key_step(carry, xs):
        ik, kt, vt = xs
        k0 = ik * plan.block_k

        def query_step(iq, c):
            dq_all, dbias, dk, dv, n = c
            q0 = iq * plan.block_q
            qt, dot = _take(qb, iq), _take(dob, iq)
            allowed = tile_allowed(plan, q0, k0, kl, ql, gdense)
            s, t = _scores(plan, qt, kt, gbias, allowed, q0, k0)
            p = jnp.exp(s - _take(lseb, iq)[..., None])
            dv = dv + _mm("bhgqk,bhgqe->bhke", p, dot)
            dp = _mm("bhgqe,bhke->bhgqk", dot, vt)
            ds = p * (dp - _take(deltab, iq)[..., None])
            if dbias is not None:
                dbias = _add_tile(dbias, ds, plan, q0, k0)
            if t is not None:  # softcap: d(c * tanh(x / c)) / dx = 1 - tanh^2
                ds = ds * (1 - t * t)
            dq = _take(dq_all, iq) + _mm("bhgqk,bhkd->bhgqd", ds, kt) * scale
            dq_all = lax.dynamic_update_index_in_dim(dq_all, dq, iq, 0)  # in place
            dk = dk + _mm("bhgqk,bhgqd->bhkd", ds, qt)  # qt holds the scale already
            return dq_all, dbias, dk, dv, n + 1

        dq_all, dbias, n = carry
        lo, hi = query_block_range(plan, ik, kl, ql)
        init = (dq_all, dbias, jnp.zeros_like(kt), jnp.zeros_like(vt), n)
        dq_all, dbias, dk, dv, n = lax.fori_loop(lo, hi, query_step, init)
        return (dq_all, dbias, n), (dk, dv)

    dbias0 = jnp.zeros_like(gbias) if bias_grad and gbias is not None else None
    index = jnp.arange(plan.num_k_blocks, dtype=jnp.int32)
    init = (jnp.zeros_like(qb), dbias0, jnp.zeros((), jnp.int32))
    (dq, dbias, tiles), (dk, dv) = lax.scan(key_step, init, (index, kb, vb))
    dbias = None if dbias is None else ungroup_full(dbias, plan)
    return (unblock_queries(dq, plan), unblock_keys(dk, plan), unblock_keys(dv, plan),
            dbias, tiles)


def _add_tile(acc: Any, ds: Any, plan: FlashPlan, q0: Any, k0: Any) -> Any:
    """``acc += ds`` summed down to the bias's broadcast shape, at tile ``(q0, k0)``."""
    tile = tile_of(acc, plan, q0, k0)
    axes = tuple(a for a in range(ds.ndim) if tile.shape[a] == 1 and ds.shape[a] != 1)
    part = jnp.sum(ds, axis=axes, keepdims=True) if axes else ds
    zero = jnp.zeros((), jnp.int32)
    start = (zero, zero, zero, q0 if tile.shape[3] > 1 else zero,
             k0 if tile.shape[4] > 1 else zero)
    return lax.dynamic_update_slice(acc, tile + part.astype(acc.dtype), start)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, kl: Any, ql: Any,
           dense: Any) -> tuple[Any, Any]:
    out, lse, _ = forward(plan, q, k, v, bias, kl, ql, dense)
    return out.astype(q.dtype), lse


def _flash_fwd(plan, q, k, v, bias, kl, ql, dense):
    # symbolic_zeros: each leaf comes with whether it is differentiated at all.
    bias_grad = bias is not None and bias.perturbed
    q, k, v, bias, kl, ql, dense = custom_vjp_primal_tree_values((q, k, v, bias, kl, ql, dense))
    out, lse, _ = forward(plan, q, k, v, bias, kl, ql, dense)
    # Structure is static: a residual (), not None, says the bias wants a gradient.
    res = (q, k, v, bias, kl, ql, dense, out, lse, () if bias_grad else None)
    return (out.astype(q.dtype), lse), res


def _flash_bwd(plan, res, cotangents):
    q, k, v, bias, kl, ql, dense, out, lse, bias_grad = res
    dout, dlse = (None if isinstance(c, SymbolicZero) else c for c in cotangents)
    if dout is None:
        dout = jnp.zeros_like(out)
    dq, dk, dv, dbias, _ = backward(plan, q, k, v, bias, kl, ql, dense, out, lse, dout,
                                    dlse, bias_grad is not None)
    dbias = None if dbias is None else dbias.astype(bias.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias,
            None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


@partial(jax.jit, static_argnums=(0,))
def flash_attention(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, kl: Any, ql: Any,
                    dense: Any) -> tuple[Any, Any]:
    """``(out, lse)`` for ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk,
    Dv)``, an optional bias and dense mask ``(B|1, Hq|1, Lq|1, Lk|1)`` and optional
    lengths ``(B,)``; differentiable in q, k, v and bias (and through lse)."""
    return _flash(plan, q, k, v, bias, kl, ql, dense)
