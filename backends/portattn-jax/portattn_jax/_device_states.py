"""Block states built on the device, for masks whose arrays are traced.

Under ``jax.jit`` (and ``vmap``) a mask's arrays are tracers, so the core's host block
form counts every tile that depends on them as partial. Here the same states are
computed from the traced arrays, in the compiled program, in time proportional to the
number of tiles and positions: lengths and ranges by comparing each block's first and
last index with them, documents from each block's smallest and largest id, global
tokens from per-position flags, prefixes and per-sequence windows like bands. Dense
masks, block layouts and mask functions are evaluated at every pair, a query block at
a time (what reading a dense mask costs anyway). Parts without traced arrays keep the
host's exact states (positional kinds: always).

States follow the core's layout, with leading axes ``(*batch, H)`` (size 1 where a part
does not vary), and are merged over them at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from portattn import masks

from ._flash_tables import per_element, traced

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["device_states"]


@dataclass(frozen=True)
class _Grid:
    """The call's tiles, and the rank of its states ``(*batch, H, nq, nk)``."""

    grid: masks.Grid
    batch_shape: tuple[int, ...]
    num_heads: int
    block_q: int
    block_k: int

    @property
    def rank(self) -> int:
        return len(self.batch_shape) + 3

    def q_axis(self, x: Any) -> Any:
        """Per query block ``(nq,)`` as ``(1, ..., 1, nq, 1)``."""
        return np.reshape(x, (1,) * (self.rank - 2) + (-1, 1))

    def k_axis(self, x: Any) -> Any:
        return np.reshape(x, (1,) * (self.rank - 2) + (1, -1))

    def column(self, a: Any) -> Any:
        """A per-batch array ``(*batch)`` as ``(*batch, 1, 1, 1)``."""
        return jnp.reshape(a, (*a.shape, 1, 1, 1))

    def full_rank(self, states: Any) -> Any:
        return jnp.reshape(states, (1,) * (self.rank - states.ndim) + states.shape)


def device_states(inputs: AttentionInputs, blocks: masks.BlockMask,
                  batch_shape: tuple[int, ...] | None = None) -> Any:
    """``(n_q_blocks, n_kv_blocks)`` int8 states of ``inputs.mask``, merged over batch
    elements and heads (hidden where hidden for all, full where full for all); with a
    ``batch_shape``, merged over heads only, ``(B, n_q_blocks, n_kv_blocks)``."""
    grid = masks.Grid.uniform(blocks.q_len, blocks.kv_len, blocks.block_q, blocks.block_k)
    g = _Grid(grid, inputs.batch_shape, inputs.num_heads, blocks.block_q, blocks.block_k)
    shape = (blocks.num_q_blocks, blocks.num_kv_blocks)
    states = _states(inputs.mask, g)
    if states is None:
        states = jnp.full(shape, masks.PARTIAL, jnp.int8)
    if batch_shape is not None:
        return per_element(jnp.broadcast_to(states, (*states.shape[:-2], *shape)),
                           batch_shape, jnp)
    lead = tuple(range(states.ndim - 2))
    high, low = jnp.max(states, axis=lead), jnp.min(states, axis=lead)
    merged = _tile_states(high == masks.HIDDEN, low == masks.FULL)
    return jnp.broadcast_to(merged, shape)


def _tile_states(hidden: Any, full: Any) -> Any:
    return masks.tile_states(hidden, full, jnp)  # the core's rule, on the device


def _states(mask: masks.Mask, g: _Grid) -> Any:
    """States of ``mask`` at the full rank, or None (partial everywhere)."""
    if mask.kind == "intersection":
        # positional parts folded into one band, as in the core's block form
        band = mask.band(g.grid.q_len, g.grid.kv_len)
        found = [] if band is None else [g.full_rank(jnp.asarray(band.block_states(g.grid)))]
        found += [_states(p, g) for p in mask.members if p.kind not in masks.POSITIONAL]
        return masks.combine_states(found, union=False, xp=jnp)
    if mask.kind == "union":
        return masks.combine_states([_states(p, g) for p in mask.members], union=True,
                                    xp=jnp)
    if not traced(mask):
        host = mask.block_states(g.grid)
        if host is not None:
            return g.full_rank(jnp.asarray(host))
    formula = _FORMULAS.get(mask.kind, _evaluated)
    return g.full_rank(formula(mask, g))


def _edges(g: _Grid) -> tuple[Any, Any, Any, Any]:
    grid = g.grid
    return (g.q_axis(grid.q_first), g.q_axis(grid.q_last), g.k_axis(grid.k_first),
            g.k_axis(grid.k_last))


def _key_lengths(part: Any, g: _Grid) -> Any:
    _, _, k_first, k_last = _edges(g)
    n = g.column(part.lengths)
    return _tile_states(k_first >= n, k_last < n)


def _query_lengths(part: Any, g: _Grid) -> Any:
    q_first, q_last, _, _ = _edges(g)
    n = g.column(part.lengths)
    return _tile_states(q_first >= n, q_last < n)


def _ranges(part: Any, g: _Grid) -> Any:
    q_first, q_last, k_first, k_last = _edges(g)
    first, last = (k_first, k_last) if part.kind == "key_ranges" else (q_first, q_last)
    start, stop = g.column(part.start), g.column(part.stop)
    hidden = (last < start) | (first >= stop) | (start >= stop)
    return _tile_states(hidden, (first >= start) & (last < stop))


def _sequence_window(part: Any, g: _Grid) -> Any:
    q_first, q_last, k_first, k_last = _edges(g)
    offset = g.column(part.key_lengths - part.query_lengths) + part.shift
    smallest, largest = k_first - q_last, k_last - q_first  # of j - i over each tile
    hidden, full = jnp.zeros((), bool), jnp.ones((), bool)
    if part.left is not None:
        lower = offset - part.left
        hidden, full = hidden | (largest < lower), full & (smallest >= lower)
    if part.right is not None:
        upper = offset + part.right
        hidden, full = hidden | (smallest > upper), full & (largest <= upper)
    return _tile_states(hidden, full)


def _prefix(part: Any, g: _Grid) -> Any:
    q_first, q_last, k_first, k_last = _edges(g)
    n = g.column(part.lengths)
    offset = part.query_offset(g.grid.q_len, g.grid.kv_len)
    q_first, q_last = q_first + offset, q_last + offset
    k_first, k_last = k_first + part.origin, k_last + part.origin
    hidden = (q_last < 0) | (q_first >= n) | (k_first >= n)
    return _tile_states(hidden, (q_first >= 0) & (q_last < n) & (k_last < n))


def _blocked(values: Any, block: int) -> Any:
    """``(..., L) -> (..., n_blocks, block)``, the last block filled with its last value
    (which changes no minimum, maximum, any or all)."""
    length = values.shape[-1]
    size = -(-length // block) * block
    widths = [(0, 0)] * (values.ndim - 1) + [(0, size - length)]
    padded = jnp.pad(values, widths, mode="edge")
    return jnp.reshape(padded, (*values.shape[:-1], size // block, block))


def _id_extremes(ids: Any, block: int) -> tuple[Any, Any, Any]:
    """Per block: smallest and largest non-negative id (``lo > hi``: all padding) and
    whether no position is padding."""
    blocks = _blocked(ids, block)
    pad = blocks < 0
    big = jnp.iinfo(ids.dtype).max
    lo = jnp.min(jnp.where(pad, big, blocks), axis=-1)
    hi = jnp.max(jnp.where(pad, -1, blocks), axis=-1)
    return lo, hi, ~jnp.any(pad, axis=-1)


def _documents(part: Any, g: _Grid) -> Any:
    q_lo, q_hi, q_exact = (x[..., None, :, None] for x in _id_extremes(part.query_ids,
                                                                        g.block_q))
    k_lo, k_hi, k_exact = (x[..., None, None, :] for x in _id_extremes(part.key_ids,
                                                                        g.block_k))
    hidden = (q_lo > q_hi) | (k_lo > k_hi) | (q_hi < k_lo) | (k_hi < q_lo)
    full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo) & q_exact & k_exact
    return _tile_states(hidden, full)  # (*batch|1, 1, nq, nk)


def _global_tokens(part: Any, g: _Grid) -> Any:
    positions = part.positions  # (n,) or (*batch, n); negative entries are unused
    lead = positions.shape[:-1]

    def flags(first: int, length: int, block: int) -> tuple[Any, Any]:
        index = jnp.arange(first, first + length, dtype=positions.dtype)
        index = jnp.reshape(index, (1,) * len(lead) + (length, 1))
        chosen = positions[..., None, :]
        found = jnp.any((index == chosen) & (chosen >= 0), axis=-1)  # (*lead, length)
        blocks = _blocked(found, block)
        return jnp.any(blocks, axis=-1), jnp.all(blocks, axis=-1)

    lq, lk = g.grid.q_len, g.grid.kv_len
    q_any, q_all = flags(part.query_offset(lq, lk), lq, g.block_q)
    k_any, k_all = flags(part.origin, lk, g.block_k)
    states = _tile_states(~q_any[..., :, None] & ~k_any[..., None, :],
                          q_all[..., :, None] | k_all[..., None, :])
    return states[..., None, :, :] if lead else states


def _evaluated(part: Any, g: _Grid) -> Any:
    """States from ``allows`` at every pair, one query block at a time, merged over
    batch elements and heads right away."""
    lq, lk, bq, bk = g.grid.q_len, g.grid.kv_len, g.block_q, g.block_k
    nq, nk = len(g.grid.q_edges) - 1, len(g.grid.k_edges) - 1
    flat = math.prod(g.batch_shape)
    b = jnp.reshape(jnp.arange(flat, dtype=jnp.int32), (flat, 1, 1, 1))
    h = jnp.reshape(jnp.arange(g.num_heads, dtype=jnp.int32), (1, g.num_heads, 1, 1))
    keys = jnp.arange(nk * bk, dtype=jnp.int32)
    k = jnp.reshape(jnp.minimum(keys, lk - 1), (1, 1, 1, -1))
    valid_k = keys < lk

    def one(a: Any) -> Any:
        rows = a * bq + jnp.arange(bq, dtype=jnp.int32)
        q = jnp.reshape(jnp.minimum(rows, lq - 1), (1, 1, -1, 1))
        with jax.numpy_rank_promotion("allow"):  # masks broadcast by the array API's rules
            allowed = jnp.asarray(part.allows(jnp, b, h, q, k, lq, lk), dtype=bool)
        allowed = jnp.reshape(allowed, (-1, *(1, 1, *allowed.shape)[-2:]))
        valid = (rows < lq)[:, None] & valid_k[None, :]
        some = jnp.any(allowed & valid[None], axis=(0, 1))
        every = jnp.all(allowed | ~valid[None], axis=(0, 1))
        return _tile_states(~jnp.any(jnp.reshape(some, (nk, bk)), axis=-1),
                            jnp.all(jnp.reshape(every, (nk, bk)), axis=-1))

    return lax.map(one, jnp.arange(nq, dtype=jnp.int32))


_FORMULAS = {
    "key_lengths": _key_lengths,
    "query_lengths": _query_lengths,
    "key_ranges": _ranges,
    "query_ranges": _ranges,
    "sequence_window": _sequence_window,
    "prefix": _prefix,
    "documents": _documents,
    "global_tokens": _global_tokens,
}
"""Kinds with arrays whose states follow from O(positions) work; the others (dense,
block layouts, mask functions) are evaluated pair by pair."""
