"""The loop along the diagonal: one unit of whole squares of rows under a
causal-shaped mask (the shape and the unit's plan: ``_diagonal_shape``).

Every diagonal square of the unit at once, in one stacked product masked by one 0/1
tile, then the keys before each square in the blocks planned for it, shared by a group
of squares where they can be. Compared with tiles that follow the staircase, that is a
few NumPy calls per unit instead of several per square, and masking by a multiply
instead of a scattered copy; with several threads every call also costs a round trip
of the GIL, so the count matters. Compared with a block per square, the shared blocks
are the ``tiles`` strategy's shape: BLAS runs such tall products faster than those of
one square's rows, and packs the keys once for all their rows. A score change by
distance (``_changes``) adds the same entries to every diagonal square, whose keys sit
at the same distances from its rows: one view added to the whole stack. Only the fast
way is tried here; a unit it cannot trust is redone in tiles, the careful way
(``_run``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ._scores import ScoreTile, accumulate_compiled, finish_fast, scores
from ._scratch import take

if TYPE_CHECKING:
    from ._units import Plan, Unit

__all__ = ["Scratch", "attend"]


class Scratch:
    """One worker's buffers for units along the diagonal, kept for later calls."""

    def __init__(self, plan: Plan) -> None:
        p, d = plan.problem, plan.strategy.shape
        dt = p.query.dtype
        rows = (d.squares + 1) * d.size  # a unit's squares and the rows after the last
        block_rows = d.group * d.size
        self.q = take("unit.q", (rows, p.query.shape[-1]), dt)
        # the values' columns, then the row sums: one add accumulates both
        self.acc = take("unit.acc", (rows, p.value.shape[-1] + 1), dt)
        self.part = take("unit.part", (block_rows, p.value.shape[-1] + 1), dt)
        # the blocks' padded tiles (the group's are the largest), and the stacked
        # squares in the same memory
        self.tile = ScoreTile("unit.scores", d.group_k, block_rows, dt)
        self.stacked = take("unit.scores", (d.squares * d.size**2,), dt)
        self.ones = np.ones(d.size, dt)  # the stacked squares' sums


def attend(plan: Plan, s: Scratch, unit: Unit) -> bool:
    """One unit the fast way (see ``_tiles``); False when it must be redone carefully."""
    p, loops, on_tile = plan.problem, plan.loops, plan.config.on_tile
    d = plan.strategy.shape
    b, h, q0, q1, lo, hi, _, planned = unit
    n, count = q1 - q0, planned.squares
    along = count * d.size
    q, acc = s.q[:n], s.acc[:n]
    np.multiply(p.query[(*b, h, slice(q0, q1))], p.factor, out=q)
    k = p.key[(*b, h // p.group)]
    v = p.value[(*b, h // p.group)]
    start = q0 + d.key_shift  # the diagonal squares, stacked: (count, keys, queries)
    if on_tile is not None:
        for r0 in range(0, along, d.size):
            on_tile(b, h, q0 + r0, q0 + r0 + d.size, start + r0, start + r0 + d.size)
    stacked = s.stacked[:count * d.size**2].reshape(count, d.size, d.size)
    scores(p, k[start:start + along].reshape(count, d.size, -1),
           q[:along].reshape(count, d.size, -1).transpose(0, 2, 1), stacked)
    if p.change is not None:  # by distance: every square's entries are the first's
        stacked += p.change.keys_by_queries(b, h, q0, q0 + d.size, start, start + d.size)
    loops.exponential(stacked)
    np.multiply(stacked, d.keep, out=stacked)
    np.matmul(stacked.transpose(0, 2, 1), v[start:start + along].reshape(count, d.size, -1),
              out=acc[:along, :-1].reshape(count, d.size, -1))
    np.matmul(s.ones[:d.size], stacked, out=acc[:along, -1].reshape(count, d.size))
    acc[along:] = 0  # rows past the last square start from nothing
    blocks = planned.blocks  # the keys before each square, then the rows past the last
    if loops.compiled is not None and blocks:  # all in one compiled call, masks included
        accumulate_compiled(loops.compiled, on_tile, s.tile, 1.0, q, k, v, acc[:, :-1],
                            acc[:, -1], blocks, planned.packed, first_writes=False,
                            unit=(b, h, q0), change=p.change)
        blocks = []
    for k0, k1, r0, r1, masks in blocks:
        if on_tile is not None:
            on_tile(b, h, q0 + r0, q0 + r1, k0, k1)
        width, part = k1 - k0, s.part[:r1 - r0]
        span, tile = s.tile.scores(width, r1 - r0)
        scores(p, k[k0:k1], q[r0:r1].T, tile, span)
        if p.change is not None:
            p.change.add(tile, b, h, q0 + r0, q0 + r1, k0, k1)
        tile = s.tile.weights(loops, width, r1 - r0, masks, part[:, -1])
        np.matmul(tile.T, v[k0:k1], out=part[:, :-1])
        acc[r0:r1] += part
    filled = acc[:planned.end]  # the other rows keep out 0 and lse -inf
    rows = (*b, h, slice(q0, q0 + planned.end))
    return finish_fast(loops.compiled, filled, filled[:, -1], hi - lo, p.out[rows],
                       None if p.lse is None else p.lse[rows])
