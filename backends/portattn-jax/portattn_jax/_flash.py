"""FlashAttention-2 in ``lax`` loops, forward and backward (:mod:`._flash_call` ties
them into one ``jax.custom_vjp``).

The loops read the mask's block form as index tables (:mod:`._flash_tables`):
forward, a ``scan`` over query blocks, each with two ``fori_loop`` over the key blocks
its table row lists, the full ones (no mask) and the partial ones (``mask.allows`` at
the tile's traced indices), with an online softmax; the trip counts are the table's
counts, so hidden tiles cost nothing. Backward: a ``scan`` over key blocks
accumulating dK and dV, with the same two loops over the query blocks that see the
block; dQ (and dBias) are loop carries updated in place. Each tile's probabilities are
recomputed from the saved log-sum-exp: memory is O(L * block), and no loop is unrolled
under ``jit``.

A score change by distance (:mod:`._flash_scores`) comes in as one more array,
``(Hq, Lq + Lk - 1)``, spread over each tile's diagonals; the backward sums each
tile's score gradient along its diagonals into that array's gradient, a loop carry
(:mod:`._flash_distance`).

Non-finite inputs follow portattn's rule: queries, keys and values are used with their
non-finite rows zeroed, and a row that its mask lets see such a key or value, or that
holds such a query and sees any key, is made NaN (so hidden padding reaches neither the
output nor the gradients). Half precision computes in float32; float32/float64 in their
own precision.

Inside ``shard_map`` the loops' first carries (zeros, ``-inf``) take the manual mesh
axes their inputs vary along (:func:`varying_like`), so the default check of varying
manual axes accepts the loops; outside it that is a no-op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax, tree_util

from portattn import dropout

from ._flash_distance import (
    add_tile_gradient,
    grouped_distances,
    tile_entries,
    ungrouped_gradient,
)
from ._flash_layout import (
    grouped_full,
    key_blocks,
    key_padding,
    query_blocks,
    tile_allowed,
    tile_of,
    unblock_keys,
    unblock_queries,
    ungroup_full,
)

if TYPE_CHECKING:
    from ._flash_layout import FlashPlan
    from ._flash_tables import Tables

__all__ = ["backward", "compute_dtype", "forward", "varying_like"]

_HIGHEST = lax.Precision.HIGHEST  # GPUs would otherwise multiply float32 in TF32


def compute_dtype(dtype: Any) -> Any:
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


def varying_like(x: Any, *sources: Any) -> Any:
    """``x`` (a pytree) unchanged in value, typed as varying along every manual mesh
    axis some leaf of ``sources`` varies along: a loop's first carry built from
    constants then has the type its steps give it inside ``shard_map``."""
    axes: set = set()
    for leaf in tree_util.tree_leaves(sources):
        axes.update(_vma(jax.typeof(leaf)))
    if not axes:
        return x

    def cast(leaf: Any) -> Any:
        missing = tuple(sorted(axes - _vma(jax.typeof(leaf)), key=str))
        if not missing:
            return leaf
        if hasattr(lax, "pcast"):
            return lax.pcast(leaf, missing, to="varying")
        return lax.pvary(leaf, missing)  # JAX before pcast

    return tree_util.tree_map(cast, x)


def _vma(aval: Any) -> frozenset:
    """The manual mesh axes a value's type varies along (none outside ``shard_map``)."""
    mat = getattr(aval, "mat", None)  # JAX 0.10: aval.mat.varying; before: aval.vma
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _mm(spec: str, a: Any, b: Any) -> Any:
    return jnp.einsum(spec, a, b, precision=_HIGHEST)


def _take(blocks: Any, i: Any) -> Any:
    return lax.dynamic_index_in_dim(blocks, i, 0, keepdims=False)


def _scores(plan: FlashPlan, qt: Any, kt: Any, bias: Any, distances: Any, allowed: Any,
            q0: Any, k0: Any) -> tuple[Any, Any]:
    """Masked scores of one tile and ``tanh`` of the soft-capped ones (or None).

    ``qt`` is already scaled, so ``qt @ kt^T`` are the scaled scores; ``distances``:
    the grouped bias by distance (or None); ``allowed`` None masks nothing.
    """
    s = _mm("bhgqd,bhkd->bhgqk", qt, kt)
    t = None
    if plan.softcap is not None:
        t = jnp.tanh(s / plan.softcap)
        s = t * plan.softcap
    if bias is not None:
        s = s + tile_of(bias, plan, q0, k0)
    if distances is not None:
        s = s + tile_entries(distances, plan, q0, k0)
    return (s if allowed is None else jnp.where(allowed, s, -jnp.inf)), t


class _Dropout:
    """Dropout's kept pairs per tile (:mod:`portattn.dropout`: the same pairs as every
    kernel given the seed), or nothing to do without a seed word."""

    def __init__(self, plan: FlashPlan, word: Any, batch: int, batch_index: Any) -> None:
        self.plan, self.word = plan, word
        if word is None:
            return
        hkv = plan.num_kv_heads
        g = plan.num_heads // hkv
        first = jnp.zeros((), jnp.int32) if batch_index is None else batch_index
        elements = first + jnp.arange(batch, dtype=jnp.int32)
        heads = (jnp.arange(hkv, dtype=jnp.int32)[:, None] * g
                 + jnp.arange(g, dtype=jnp.int32)[None, :])
        self.rows = (elements[:, None, None] * plan.num_heads + heads[None])[..., None, None]
        self.inverse = 1.0 / (1.0 - plan.dropout_p)

    def kept(self, q0: Any, k0: Any) -> Any:
        positions = (self.plan.block_q, self.plan.block_k)
        i, j = (start + jnp.arange(n, dtype=jnp.int32) for start, n in zip(
            (q0, k0), positions, strict=True))
        return dropout.kept(self.word, self.rows, i[:, None][None, None, None],
                            j[None, :][None, None, None], self.plan.dropout_p)

    def applied(self, x: Any, keep: Any) -> Any:
        """``x`` dropped where ``keep`` is False, the rest divided by ``1 - p``."""
        return x if keep is None else jnp.where(keep, x * self.inverse, 0)

    def tile(self, q0: Any, k0: Any) -> Any:
        return None if self.word is None else self.kept(q0, k0)


def _tile_mask(plan: FlashPlan, mask: Any, masked: bool, q0: Any, k0: Any,
               batch_index: Any) -> Any:
    """What hides pairs of a tile: the mask for a partial one, else the key padding."""
    return tile_allowed(plan, mask, q0, k0, batch_index) if masked else key_padding(plan, k0)


def _split(x: Any) -> tuple[Any, Any]:
    """``(clean, bad)``: ``(B, H, L, D)`` with non-finite rows zeroed, and ``(B, H, L)``
    marking them."""
    bad = ~jnp.all(jnp.isfinite(x), axis=-1)
    return jnp.where(bad[..., None], jnp.zeros((), x.dtype), x), bad


def _prepared(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, distances: Any) -> tuple:
    ct = compute_dtype(q.dtype)
    (q, bad_q), (k, bad_k), (v, bad_v) = (_split(a.astype(ct)) for a in (q, k, v))
    # A hidden key has weight exactly 0, but 0 * NaN is NaN: the loops use clean rows,
    # and ``marks`` (2: the key was not finite, 1: the value) says which rows see one.
    marks = jnp.maximum(2 * bad_k.astype(ct), bad_v.astype(ct))[..., None]
    qb = query_blocks(q * jnp.asarray(plan.scale, ct), plan)
    kb, vb, mb = key_blocks(k, plan), key_blocks(v, plan), key_blocks(marks, plan)
    gbias = None if bias is None else grouped_full(bias.astype(ct), plan, 0)
    gdist = None if distances is None else grouped_distances(distances.astype(ct), plan)
    return ct, qb, query_blocks(bad_q, plan, False), kb, vb, mb, gbias, gdist


def _two_loops(counts: tuple[Any, Any], indices: tuple[Any, Any], step: Any,
               carry: Any) -> Any:
    """``step(block, masked, carry)`` over the full blocks of a table row, then over its
    partial ones (the online softmax and the gradient sums do not depend on order)."""
    for count, index, masked in zip(counts, indices, (False, True), strict=True):
        carry = lax.fori_loop(0, count, lambda t, c, index=index, masked=masked: step(
            _take(index, t), masked, c), carry)
    return carry


def forward(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, mask_leaves: tuple,
            tables: Tables, word: Any = None, batch_index: Any = None,
            distances: Any = None) -> tuple[Any, Any, Any]:
    """``(out, lse, tiles)``: out ``(B, Hq, Lq, Dv)`` and lse ``(B, Hq, Lq)`` in the
    compute dtype, and the number of tiles visited. ``word``: dropout's seed word
    (None: no dropout); ``batch_index``: the flat batch index of a single batch
    element (``B == 1``), for the mask and dropout; ``distances``: a bias by distance
    ``(Hq, Lq + Lk - 1)`` (None: none)."""
    ct, qb, bad_qb, kb, vb, mb, gbias, gdist = _prepared(plan, q, k, v, bias, distances)
    mask = plan.mask(mask_leaves)
    sources = (q, k, v, bias, mask_leaves, tables, word, batch_index, distances)
    _, b, hkv, g, bq, _ = qb.shape
    dv = v.shape[-1]
    drop = _Dropout(plan, word, b, batch_index)

    def query_step(tiles, xs):
        iq, qt, bad_q, n_full, full_row, n_part, part_row = xs
        q0 = iq * plan.block_q

        def key_step(ik, masked, carry):
            acc, m, denom, seen, n = carry
            k0 = ik * plan.block_k
            allowed = _tile_mask(plan, mask, masked, q0, k0, batch_index)
            s, _ = _scores(plan, qt, _take(kb, ik), gbias, gdist, allowed, q0, k0)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0, m_new)  # rows with no key yet
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pd = drop.applied(p, drop.tile(q0, k0))  # the denominator sums p
            acc = acc * alpha[..., None] + _mm("bhgqk,bhke->bhgqe", pd, _take(vb, ik))
            # the worst mark among the keys a row's scores do not hide (-inf), whatever
            # their weight
            marks = _take(mb, ik)[..., 0][:, :, None, None, :]
            seen = jnp.maximum(seen, jnp.max(jnp.where(s > -jnp.inf, marks, 0), axis=-1))
            return acc, m_new, denom * alpha + jnp.sum(p, axis=-1), seen, n + 1

        rows = (b, hkv, g, bq)
        init = (*varying_like((jnp.zeros((*rows, dv), ct), jnp.full(rows, -jnp.inf, ct),
                               jnp.zeros(rows, ct), jnp.zeros(rows, ct)), sources), tiles)
        acc, m, denom, seen, tiles = _two_loops((n_full, n_part), (full_row, part_row),
                                                key_step, init)
        has_mass = denom > 0
        safe = jnp.where(has_mass, denom, 1)
        lse_nan = (seen >= 2) | (bad_q & (m > -jnp.inf))
        lse = jnp.where(has_mass, m + jnp.log(safe), -jnp.inf)
        lse = jnp.where(lse_nan, jnp.nan, lse)
        out = jnp.where((lse_nan | (seen >= 1))[..., None], jnp.nan, acc / safe[..., None])
        return tiles, (out, lse)

    index = jnp.arange(plan.num_q_blocks, dtype=jnp.int32)
    xs = (index, qb, bad_qb, tables.full_kv_num, tables.full_kv_indices, tables.kv_num,
          tables.kv_indices)
    tiles, (out, lse) = lax.scan(query_step, jnp.zeros((), jnp.int32), xs)
    return unblock_queries(out, plan), unblock_queries(lse, plan), tiles


def backward(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, mask_leaves: tuple,
             tables: Tables, out: Any, lse: Any, dout: Any, dlse: Any,
             bias_grad: bool, word: Any = None, batch_index: Any = None,
             distances: Any = None,
             distance_grad: bool = False) -> tuple[Any, Any, Any, Any, Any, Any]:
    """``(dq, dk, dv, dbias, ddistances, tiles)`` in the compute dtype; ``dlse`` may be
    None, dbias is None unless ``bias_grad`` (then shaped like ``bias``), ddistances
    None unless ``distance_grad`` (then ``(Hq, Lq + Lk - 1)``, summed over the batch).
    With dropout (``word``) each tile's kept pairs are drawn again: ``dV += (P Z)^T
    dO``, ``dS = P (dP Z - Delta)`` for ``Z`` the kept pairs over ``1 - p``."""
    ct, qb, _, kb, vb, _, gbias, gdist = _prepared(plan, q, k, v, bias, distances)
    mask = plan.mask(mask_leaves)
    drop = _Dropout(plan, word, qb.shape[1], batch_index)
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
        ik, kt, vt, n_full, full_col, n_part, part_col = xs
        k0 = ik * plan.block_k

        def query_step(iq, masked, c):
            dq_all, dbias, ddist, dk, dv, n = c
            q0 = iq * plan.block_q
            qt, dot = _take(qb, iq), _take(dob, iq)
            allowed = _tile_mask(plan, mask, masked, q0, k0, batch_index)
            s, t = _scores(plan, qt, kt, gbias, gdist, allowed, q0, k0)
            p = jnp.exp(s - _take(lseb, iq)[..., None])
            keep = drop.tile(q0, k0)
            dv = dv + _mm("bhgqk,bhgqe->bhke", drop.applied(p, keep), dot)
            dp = drop.applied(_mm("bhgqe,bhke->bhgqk", dot, vt), keep)
            ds = p * (dp - _take(deltab, iq)[..., None])
            if dbias is not None:
                dbias = _add_tile(dbias, ds, plan, q0, k0)
            if ddist is not None:
                ddist = add_tile_gradient(ddist, ds, plan, q0, k0)
            if t is not None:  # softcap: d(c * tanh(x / c)) / dx = 1 - tanh^2
                ds = ds * (1 - t * t)
            dq = _take(dq_all, iq) + _mm("bhgqk,bhkd->bhgqd", ds, kt) * scale
            dq_all = lax.dynamic_update_index_in_dim(dq_all, dq, iq, 0)  # in place
            dk = dk + _mm("bhgqk,bhgqd->bhkd", ds, qt)  # qt holds the scale already
            return dq_all, dbias, ddist, dk, dv, n + 1

        dq_all, dbias, ddist, n = carry
        init = (dq_all, dbias, ddist, *varying_like((jnp.zeros_like(kt), jnp.zeros_like(vt)),
                                                    sources), n)
        dq_all, dbias, ddist, dk, dv, n = _two_loops((n_full, n_part), (full_col, part_col),
                                                     query_step, init)
        return (dq_all, dbias, ddist, n), (dk, dv)

    sources = (q, k, v, bias, mask_leaves, tables, out, lse, dout, dlse, word,
               batch_index, distances)
    dbias0 = jnp.zeros_like(gbias) if bias_grad and gbias is not None else None
    ddist0 = jnp.zeros_like(gdist) if distance_grad and gdist is not None else None
    index = jnp.arange(plan.num_k_blocks, dtype=jnp.int32)
    init = (*varying_like((jnp.zeros_like(qb), dbias0, ddist0), sources),
            jnp.zeros((), jnp.int32))
    xs = (index, kb, vb, tables.full_q_num, tables.full_q_indices, tables.q_num,
          tables.q_indices)
    (dq, dbias, ddist, tiles), (dk, dv) = lax.scan(key_step, init, xs)
    dbias = None if dbias is None else ungroup_full(dbias, plan)
    ddist = None if ddist is None else ungrouped_gradient(ddist, plan)
    return (unblock_queries(dq, plan), unblock_keys(dk, plan), unblock_keys(dv, plan),
            dbias, ddist, tiles)


def _add_tile(acc: Any, ds: Any, plan: FlashPlan, q0: Any, k0: Any) -> Any:
    """``acc += ds`` summed down to the bias's broadcast shape, at tile ``(q0, k0)``."""
    tile = tile_of(acc, plan, q0, k0)
    axes = tuple(a for a in range(ds.ndim) if tile.shape[a] == 1 and ds.shape[a] != 1)
    part = jnp.sum(ds, axis=axes, keepdims=True) if axes else ds
    zero = jnp.zeros((), jnp.int32)
    start = (zero, zero, zero, q0 if tile.shape[3] > 1 else zero,
             k0 if tile.shape[4] > 1 else zero)
    return lax.dynamic_update_slice(acc, tile + part.astype(acc.dtype), start)
