"""A bias by distance on the ``jax_flash`` tiles: one entry per head and distance
``j - i`` (a score change's :meth:`~portattn.scores.ScoreChange.by_distance` array,
``(Hq, Lq + Lk - 1)``, the entry of query ``i`` and key ``j`` at ``j - i + Lq - 1``).

A tile at traced ``(q0, k0)`` reads the ``block_q + block_k - 1`` distances it holds,
one slice at a traced offset, and spreads them over its diagonals; its score gradient,
summed over the batch and along its diagonals (by runs of rows), is added back at the
same offset. The loops visit tiles in a fixed order, so the sums are the same on every
run, and nothing of size ``Lq x Lk`` is made. The array is padded with zeros to whole
blocks on both sides, so the tiles that hang over the sequences' ends read inside it:
their padded keys are hidden and their padded queries dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
    from ._flash_layout import FlashPlan

__all__ = ["add_tile_gradient", "grouped_distances", "tile_entries", "ungrouped_gradient"]


def _padding(plan: FlashPlan) -> tuple[int, int]:
    """Zeros before and after the distances: the padded queries' and keys' share."""
    return plan.num_q_blocks * plan.block_q - plan.lq, plan.num_k_blocks * plan.block_k - plan.lk


def _window(plan: FlashPlan, q0: Any, k0: Any) -> tuple[Any, int]:
    """``(start, width)`` of the tile's distances in the padded array: its lowest,
    ``k0 - (q0 + block_q - 1)``, counted from the grid's ``-(nq * block_q - 1)``."""
    start = k0 - q0 + (plan.num_q_blocks - 1) * plan.block_q
    return start, plan.block_q + plan.block_k - 1


def grouped_distances(distances: Any, plan: FlashPlan) -> Any:
    """``(Hq, Lq + Lk - 1)`` as ``(Hkv, G, nq * block_q + nk * block_k - 1)``: grouped
    like the queries, padded with zeros to the whole grid."""
    before, after = _padding(plan)
    padded = jnp.pad(distances, ((0, 0), (before, after)))
    hkv = plan.num_kv_heads
    return jnp.reshape(padded, (hkv, plan.num_heads // hkv, padded.shape[-1]))


def tile_entries(grouped: Any, plan: FlashPlan, q0: Any, k0: Any) -> Any:
    """``(1, Hkv, G, block_q, block_k)``: the entries of the tile at ``(q0, k0)``."""
    start, width = _window(plan, q0, k0)
    window = lax.dynamic_slice_in_dim(grouped, start, width, axis=2)
    bq, bk = plan.block_q, plan.block_k
    # entry (i, j) of the tile reads diagonal j - i + block_q - 1 of its window (one
    # gather measured faster on CPUs than copies that shift the rows)
    diagonal = (jnp.arange(bk, dtype=jnp.int32)[None, :]
                - jnp.arange(bq, dtype=jnp.int32)[:, None] + (bq - 1))
    return jnp.take(window, diagonal, axis=2, mode="clip")[None]


def add_tile_gradient(acc: Any, ds: Any, plan: FlashPlan, q0: Any, k0: Any) -> Any:
    """``acc`` (grouped, padded) plus the tile's score gradient ``ds`` ``(B, Hkv, G,
    block_q, block_k)`` summed over the batch and along its diagonals."""
    start, width = _window(plan, q0, k0)
    sums = _diagonal_sums(jnp.sum(ds, axis=0).astype(acc.dtype))
    window = lax.dynamic_slice_in_dim(acc, start, width, axis=2)
    return lax.dynamic_update_slice_in_dim(acc, window + sums, start, axis=2)


def ungrouped_gradient(acc: Any, plan: FlashPlan) -> Any:
    """The inverse of :func:`grouped_distances` for the summed gradient: ``(Hq, Lq +
    Lk - 1)``, padding dropped."""
    before, _ = _padding(plan)
    flat = jnp.reshape(acc, (plan.num_heads, acc.shape[-1]))
    return flat[:, before:before + plan.lq + plan.lk - 1]


#: Rows summed at once in the first step of :func:`_diagonal_sums`: one pass over the
#: tile leaves an eighth of it for the pairwise steps.
FIRST_RUN = 8


def _diagonal_sums(x: Any) -> Any:
    """``(..., tq + tk - 1)``: the sums of ``x`` ``(..., tq, tk)`` along its diagonals
    ``j - i + tq - 1``.

    By runs of rows, not by a scatter: each run's rows are added, each moved along by
    its distance from the run's last row (earlier rows' diagonals lie further right),
    first in runs of :data:`FIRST_RUN` rows, then pairwise, the earlier run moved by
    the length of a run; contiguous copies and adds in a fixed order. Rows are counted
    up to a power of two, the extra ones (zeros) first."""
    *lead, tq, tk = x.shape
    whole = 1 << (tq - 1).bit_length()
    pad = [(0, 0)] * len(lead)
    if whole > tq:
        x = jnp.pad(x, [*pad, (whole - tq, 0), (0, 0)])
    run = min(FIRST_RUN, whole)
    rows = jnp.reshape(x, (*lead, whole // run, run, tk))
    x = sum(jnp.pad(rows[..., u, :], [*pad, (0, 0), (run - 1 - u, u)]) for u in range(run))
    while x.shape[-2] > 1:
        earlier, later = x[..., 0::2, :], x[..., 1::2, :]
        x = (jnp.pad(earlier, [*pad, (0, 0), (run, 0)])
             + jnp.pad(later, [*pad, (0, 0), (0, run)]))
        run *= 2
    return x[..., 0, :tq + tk - 1]
