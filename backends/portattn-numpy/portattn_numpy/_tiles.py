"""The loop of tiles: one query tile of one head against the blocks planned for it
(``_blocks``), the fast way or the careful way.

Each key block costs two BLAS products and a few in-place ufunc passes over a score
tile that stays near the core (``_scores.ScoreTile``); a bias and a score change
(``_changes``) join its scores after the product. Without a bias, or a score change
other than by distance, the scores are kept in base 2 (``log2(e)`` folded into the
queries) where an ``exp2`` is the fastest exponential (``_exponential``). Two ways
through a unit:

* fast: ``p = exp(s)`` with no max subtracted. ``exp`` has the same relative accuracy
  over its whole normal range, so this is as accurate as subtracting the max as long
  as nothing overflows and each row's largest term stays a normal number. Afterwards
  the row sums tell whether that held; if not, the unit is computed again the careful
  way (in a plan of its own, ``_plan.careful``, run by ``_run``).
* careful: the online softmax of flash attention (running row max, rescaled sums).
  The untrusted units of every strategy are redone this way, in tiles.

Exponentials, masks and row sums come from ``ScoreTile.weights`` (one compiled pass
where Numba is installed); the careful way sets masked entries to ``-inf`` before its
max. Where Numba and NumPy's BLAS allow, the fast way's blocks, their masks included,
run in one compiled call, and its last step in another (``_compiled_blocks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import slice_tile

from ._problem import head_view
from ._scores import ScoreTile, accumulate_compiled, add_bias, finish_fast, hide, scores
from ._scratch import take

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._loops import Loops
    from ._problem import Problem
    from ._units import Block, Plan, Unit

__all__ = ["Scratch", "attend"]


class Scratch:
    """One worker's buffers for every unit of a plan (``role``: ``unit`` for the fast
    way, ``careful`` for units redone carefully), kept for later calls."""

    def __init__(self, plan: Plan) -> None:
        p = plan.problem
        role = "careful" if plan.careful else "unit"
        dt, tq, tk, dv = p.query.dtype, p.block_q, p.block_k, p.value.shape[-1]
        self.q = take(f"{role}.q", (tq, p.query.shape[-1]), dt)
        self.tile = ScoreTile(f"{role}.scores", tk, tq, dt)
        self.acc = take(f"{role}.acc", (tq, dv), dt)
        self.acc_part = take(f"{role}.acc_part", (tq, dv), dt)
        # sums, partial sums, max, new max, rescale
        self.rows = take(f"{role}.rows", (5, tq), dt)


def attend(plan: Plan, s: Scratch, unit: Unit) -> bool:
    """One tile, the way ``plan`` says; the fast way returns False, writing nothing,
    when it is not trusted."""
    p, loops, on_tile, careful = plan.problem, plan.loops, plan.config.on_tile, plan.careful
    b, h, q0, q1, lo, hi, _, planned = unit
    n = q1 - q0
    blocks = planned.blocks
    if not blocks:
        return True  # out is already 0 and lse -inf
    query = p.query[(*b, h, slice(q0, q1))]
    k = p.key[(*b, h // p.group)]
    v = p.value[(*b, h // p.group)]
    compiled = loops.compiled
    if not careful and compiled is not None:
        # every block in one compiled call, masks included; where BLAS can read the
        # queries in place, the product scales them
        q, alpha = ((query, p.factor) if p.query_ready
                    else (np.multiply(query, p.factor, out=s.q[:n]), 1.0))
        acc, sums = s.acc[:n], s.rows[0, :n]
        first_writes = blocks[0][2:4] == (0, n)  # else acc and sums start from zeros
        if not first_writes:
            acc[:] = 0
            sums[:] = 0
        accumulate_compiled(compiled, on_tile, s.tile, alpha, q, k, v, acc, sums,
                            blocks, planned.packed, first_writes=first_writes,
                            unit=(b, h, q0), change=p.change)
    else:
        q = np.multiply(query, p.factor, out=s.q[:n])
        _accumulate(p, loops, on_tile, s, q, k, v, b, h, q0, q1, blocks, careful=careful)
    first, end = planned.first, planned.end  # the other rows keep out 0 and lse -inf
    if not careful:
        rows = (*b, h, slice(q0 + first, q0 + end))
        return finish_fast(compiled, s.acc[first:end], s.rows[0, first:end], hi - lo,
                           p.out[rows], None if p.lse is None else p.lse[rows])
    shift = s.rows[2, first:end]
    if p.base2:
        shift *= np.log(2.0)
    _finish(p, s, b, h, q0, first, end, shift)
    return True


def _accumulate(p: Problem, loops: Loops, on_tile: Callable[..., Any] | None, s: Scratch,
                q: Any, k: Any, v: Any, b: tuple[int, ...], h: int, q0: int, q1: int,
                blocks: list[Block], *, careful: bool) -> None:
    """The blocks' weights times values into ``s.acc``, their sums into ``s.rows[0]``,
    by NumPy's calls; ``q`` are the scaled queries."""
    n = q1 - q0
    acc, part = s.acc[:n], s.acc_part[:n]
    sums, part_sums, m, m_new, scale = (row[:n] for row in s.rows)
    # A first block that covers every row (the usual case) writes acc and sums instead
    # of adding to zeros; the careful way's rescaling of them before it is overwritten.
    first_covers_all = blocks[0][2:4] == (0, n)
    if not first_covers_all:
        acc[:] = 0
        sums[:] = 0
    m[:] = -np.inf
    bias = None if p.bias is None else head_view(p.bias, b, h)
    for i, (k0, k1, r0, r1, masks) in enumerate(blocks):
        if on_tile is not None:
            on_tile(b, h, q0 + r0, q0 + r1, k0, k1)
        width, rows = k1 - k0, slice(r0, r1)
        span, tile = s.tile.scores(width, r1 - r0)
        scores(p, k[k0:k1], q[rows].T, tile, span)
        if bias is not None:
            add_bias(tile, slice_tile(bias, q0 + r0, q0 + r1, k0, k1))
        if p.change is not None:
            p.change.add(tile, b, h, q0 + r0, q0 + r1, k0, k1)
        if careful:
            hide(tile, masks, -np.inf)
            _shift(tile, acc[rows], sums[rows], m[rows], m_new[rows], scale[rows],
                   loops.exponential)
            masks = []  # hidden already
        if i == 0 and first_covers_all:
            tile = s.tile.weights(loops, width, r1 - r0, masks, sums)
            np.matmul(tile.T, v[k0:k1], out=acc)
            continue
        tile = s.tile.weights(loops, width, r1 - r0, masks, part_sums[rows])
        np.matmul(tile.T, v[k0:k1], out=part[rows])
        acc[rows] += part[rows]
        sums[rows] += part_sums[rows]
    if careful:
        m[:] = _finite(m)


def _shift(tile: Any, acc: Any, sums: Any, m: Any, m_new: Any, alpha: Any,
           exp: Any) -> None:
    """The online softmax step: raise the running max, rescale, subtract it."""
    np.max(tile, axis=0, out=m_new)
    np.maximum(m, m_new, out=m_new)
    # rows with nothing summed yet (m = -inf) get alpha 0, never exp(+large) * 0
    np.subtract(m, _finite(m_new), out=alpha)
    exp(alpha)
    acc *= alpha[:, None]
    sums *= alpha
    m[:] = m_new
    np.subtract(tile, _finite(m), out=tile)


def _finite(m: Any) -> Any:
    """Row maxima with ``-inf`` (rows with nothing allowed so far) read as 0."""
    return np.where(np.isneginf(m), 0, m)


def _finish(p: Problem, s: Scratch, b: tuple[int, ...], h: int, q0: int, first: int,
            end: int, shift: Any) -> None:
    """The careful way's last step for the unit's rows ``first:end`` (``shift``: each
    row's max, in base e)."""
    sums, acc = s.rows[0, first:end], s.acc[first:end]
    rows = (*b, h, slice(q0 + first, q0 + end))
    out = p.out[rows]
    lse = None if p.lse is None else p.lse[rows]
    # Rows with no allowed key (sum 0) keep out 0 and lse -inf; a NaN sum (a NaN query,
    # scores that overflowed) gives NaN, never a finite answer.
    has_mass = np.logical_not(sums <= 0)
    np.divide(acc, sums[:, None], out=out, where=has_mass[:, None])
    if lse is not None:
        np.log(sums, out=lse, where=has_mass)
        np.add(lse, shift, out=lse, where=has_mass)
