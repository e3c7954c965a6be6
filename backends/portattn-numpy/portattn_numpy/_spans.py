"""A unit's blocks laid along each row's one run of keys (``Mask.key_spans``), for
masks that give them (causal, windows, documents and their intersections), with no
pair evaluated one by one.

Keys are cut where a row of the block form's tiles starts or stops seeing them (a
diagonal's squares, a document's edges), and further into at most ``block_k``: each
row of tiles then sees every key of a piece or none, so no block holds a tile the
block form hides. When the runs' starts and stops grow with the row, the rows that see
a piece are one run, and so are those that see all of it; consecutive pieces seen by
the same rows make one block, and the rows that see a piece in part get its entries
masked, from their runs. Rows at either end that see no key are left out; units whose
runs do not grow, or with such a row between others, are planned from the block form
instead (``_blocks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._units import UnitBlocks

if TYPE_CHECKING:
    from ._memo import CallPlans
    from ._problem import Problem
    from ._units import Block

__all__ = ["span_blocks"]


def span_blocks(p: Problem, plans: CallPlans, lead: tuple[int, ...], q0: int,
                q1: int) -> UnitBlocks | None:
    """The blocks of rows ``q0:q1`` where the block form's states are read at ``lead``;
    None where the runs cannot plan them (see the module's docstring)."""
    runs = _unit_runs(p, lead, q0, q1)
    if runs is None:
        return None
    first, start, stop = runs
    if not len(start):
        return UnitBlocks([], 0, 0)
    # the rows of the block form's tiles: between two cuts, each sees every key or none
    # (cut where it starts and stops seeing them, and around keys its rows skip)
    step, r0, r1 = p.blocks.block_q, q0 + first, q0 + first + len(start)
    edges = np.clip(np.arange(r0 // step, -(-r1 // step) + 1) * step, r0, r1) - r0
    gaps = np.flatnonzero(stop[:-1] < start[1:])
    cuts = np.unique(np.concatenate([start[edges[:-1]], stop[edges[1:] - 1], stop[gaps],
                                     start[gaps + 1]]))
    pieces = [np.arange(a, z, p.block_k) for a, z in zip(cuts[:-1].tolist(), cuts[1:].tolist(),
                                                          strict=True)]
    c0 = np.concatenate([*pieces, cuts[-1:]])
    c0, c1 = c0[:-1], c0[1:]
    top = np.searchsorted(stop, c0, "right")  # the first row that sees the keys
    end = np.searchsorted(start, c1, "left")  # past the last one
    # the rows that see all of them: [whole0, whole1), else none
    whole0 = np.maximum(top, np.searchsorted(stop, c1, "left"))
    whole1 = np.minimum(end, np.searchsorted(start, c0, "right"))
    none = whole0 >= whole1
    whole0, whole1 = np.where(none, end, whole0), np.where(none, end, whole1)
    made = plans.local.setdefault("hidden by runs", {})
    blocks: list[Block] = []
    block = None
    for k0, k1, a, z, w0, w1 in zip(c0.tolist(), c1.tolist(), top.tolist(), end.tolist(),
                                    whole0.tolist(), whole1.tolist(), strict=True):
        if a >= z:  # no row sees them (keys between documents)
            block = None
            continue
        if block is not None and block[2:4] == [a, z] and k1 - block[0] <= p.block_k:
            block[1] = k1
        else:
            block = [k0, k1, a, z, []]
            blocks.append(block)
        for b0, b1 in ((a, w0), (w1, z)):  # the rows that see them in part
            if b1 > b0:
                block[4].append((k0 - block[0], b0 - a,
                                 _hidden(made, start[b0:b1] - k0, stop[b0:b1] - k0, k1 - k0)))
    return UnitBlocks([(k0, k1, a + first, z + first, hidden)
                       for k0, k1, a, z, hidden in blocks], first, first + len(start))


def _hidden(made: dict, start: Any, stop: Any, keys: int) -> Any:
    """The entries rows whose runs are ``start:stop`` hide among keys ``0:keys``: made
    once per call for each pattern (a diagonal's squares repeat theirs), read only."""
    start, stop = np.minimum(np.maximum(start, 0), keys), np.minimum(np.maximum(stop, 0), keys)
    pattern = (keys, start.tobytes(), stop.tobytes())
    hidden = made.get(pattern)
    if hidden is None:
        columns = np.arange(keys)
        hidden = made[pattern] = (columns < start[:, None]) | (columns >= stop[:, None])
        hidden.flags.writeable = False  # blocks and kept plans share it
    return hidden


def _unit_runs(p: Problem, lead: tuple[int, ...], q0: int,
               q1: int) -> tuple[int, Any, Any] | None:
    """``(first, start, stop)``: the runs of the rows of ``q0:q1`` that see some key, from
    row ``first`` of the unit, read where the states are read at ``lead``; None when the
    mask has none, varies where the states do not, or the runs do not grow or leave rows
    without keys between others."""
    spans = p.spans
    if spans is None or q1 <= q0:
        return None
    start, stop = spans
    own, states = start.shape[:-1], p.blocks.states.shape[:-2]
    if len(own) > len(states):
        return None
    at = []
    for size, shared, i in zip(own, states[len(states) - len(own):],
                               lead[len(lead) - len(own):], strict=True):
        if size != 1 and shared == 1:  # plans are kept where the states are read
            return None
        at.append(0 if size == 1 else i)
    start, stop = start[tuple(at)][q0:q1], stop[tuple(at)][q0:q1]
    rows = np.flatnonzero(stop > start)
    if not rows.size:
        return 0, start[:0], stop[:0]
    first, end = int(rows[0]), int(rows[-1]) + 1
    if len(rows) != end - first:
        return None
    start, stop = start[first:end], stop[first:end]
    if (np.diff(start) < 0).any() or (np.diff(stop) < 0).any():
        return None
    return first, start, stop
