"""The pairs a unit's mask allows where its block form leaves tiles partial, and the
blocks cut to them.

The mask is read for one unit's batch element and head (:class:`UnitMask`): the pairs
of a tile (``allowed``, from the mask's ``tile``) and the block form of a part on a
finer grid (``states``). Key blocks that most rows of tiles leave partial (a global
token's column) are read over every query once per call and kept, rather than unit by
unit. ``_blocks`` hands over a unit's regions of tiles, in key order: a block whose
partial tiles are masked entry by entry (:func:`_block`), or tiles none of which is
full, cut to the pairs the mask allows (:func:`_allowed_only`, read on a finer grid
first when large); :func:`blocks_of` plans them and leaves out the rows at either end
that attend nothing.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import FULL, HIDDEN, PARTIAL, Grid

from ._problem import head_view
from ._units import UnitBlocks

if TYPE_CHECKING:
    from ._memo import CallPlans
    from ._problem import Problem
    from ._units import Block

__all__ = ["Region", "UnitMask", "alike", "blocks_of", "runs_of"]

Region = tuple[Any, int, int, Any]
"""``(edges, k0, k1, states)``: keys ``k0:k1`` against the rows of tiles that start at
``edges``; ``states`` their tiles on the call's grid, to make one block of, masked where
they are partial, or None: no tile is full, so the blocks are cut to the pairs the mask
allows."""


def blocks_of(p: Problem, plans: CallPlans, b: tuple[int, ...], h: int, q0: int,
              regions: list[Region], n: int) -> tuple[UnitBlocks, bool]:
    """``(plan, shared)``: the blocks of ``regions`` of the ``n`` rows from ``q0`` of
    batch element ``b``, head ``h``, cut to the rows that attend some key; ``shared``:
    whether every batch element and head that reads the same block form may share
    them (the mask did not vary where the block form does not)."""
    mask = UnitMask(p, plans, b, h, q0)
    step, cut = p.blocks.block_k, p.block_k
    blocks: list[Block] = []
    for edges, k0, k1, states in regions:
        blocks += (_allowed_only(mask, edges, k0, k1, step, cut) if states is None
                   else _block(mask, states, edges, k0, k1))
    return _trimmed(blocks, n), mask.shared


#: Share of the rows of tiles a key block must leave partial for its tile to be read
#: over every query once per call (a global token's column) rather than unit by unit.
_COLUMN = 0.75


def _columns(p: Problem, plans: CallPlans) -> list[int]:
    """How many of the first ``c`` key blocks of the call's grid are read over every
    query at once, for each ``c`` (a list: read for every tile a plan evaluates)."""
    found = plans.local.get("columns")
    if found is None:
        partial = p.blocks.states == PARTIAL
        read = partial.reshape(-1, partial.shape[-1]).mean(axis=0) >= _COLUMN
        found = plans.local["columns"] = [0, *np.cumsum(read).tolist()]
    return found


class UnitMask:
    """What the mask says of one unit's batch element and head: the pairs of a tile
    (``allowed``) and the block form of a part on a finer grid (``states``), noting
    whether the mask varied where the call's block form does not (``shared``). What it
    reads for every unit is kept in the call's ``plans``."""

    def __init__(self, p: Problem, plans: CallPlans, b: tuple[int, ...], h: int,
                 q0: int) -> None:
        self.p, self.plans, self.b, self.h, self.q0 = p, plans, b, h, q0
        self.shared = True

    def allowed(self, r0: int, r1: int, k0: int, k1: int) -> Any:
        """``(rows, keys)`` booleans, True = attend, for the unit's rows ``r0:r1``."""
        p, q0 = self.p, self.q0
        step = p.blocks.block_k
        c0, c1 = k0 // step, -(-k1 // step)
        columns = _columns(p, self.plans)
        if columns[c1] - columns[c0] == c1 - c0:  # read once per call, for every unit
            parts = [self._column(c) for c in range(c0, c1)]
            tile = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
            return tile[q0 + r0:q0 + r1, k0 - c0 * step:k1 - c0 * step]
        tile = self._own(np.asarray(p.mask.tile(np, q0 + r0, q0 + r1, k0, k1, p.q_len,
                                                p.kv_len)))
        shape = (r1 - r0, k1 - k0)
        return tile if tile.shape == shape else np.broadcast_to(tile, shape)

    def _column(self, c: int) -> Any:
        """The tile of the call's key block ``c`` over every query, kept for the call."""
        p = self.p
        k0, k1 = c * p.blocks.block_k, min(p.kv_len, (c + 1) * p.blocks.block_k)
        tile = self.plans.local.get(("column", c))
        if tile is None:
            tile = self.plans.local["column", c] = np.asarray(
                p.mask.tile(np, 0, p.q_len, k0, k1, p.q_len, p.kv_len))
        return np.broadcast_to(self._own(tile), (p.q_len, k1 - k0))

    def states(self, r0: int, r1: int, k0: int, k1: int, rows: int,
               keys: int) -> tuple[Any, Any, Any] | None:
        """``(states, row edges, key edges)``: the block form of the unit's rows ``r0:r1``
        and keys ``k0:k1`` in tiles of ``rows x keys``; None where the mask cannot tell."""
        p, q0 = self.p, self.q0
        q_edges = np.append(np.arange(q0 + r0, q0 + r1, rows), q0 + r1)
        k_edges = np.append(np.arange(k0, k1, keys), k1)
        states = p.mask.block_states(Grid(q_edges, k_edges, p.q_len, p.kv_len))
        if states is None:
            return None
        shape = (len(q_edges) - 1, len(k_edges) - 1)
        return np.broadcast_to(self._own(np.asarray(states)), shape), q_edges - q0, k_edges

    def _own(self, a: Any) -> Any:
        """This batch element's and head's part of ``a`` (full rank when it has leading
        axes, which broadcast against ``(*batch, H)``)."""
        if a.ndim <= 2:
            return a
        rank = len(self.b) + 3
        a = a.reshape((1,) * (rank - a.ndim) + a.shape)
        states = self.p.blocks.states.shape[:-2]
        states = (1,) * (rank - 2 - len(states)) + states
        if any(t > 1 and s == 1 for t, s in zip(a.shape[:-2], states, strict=True)):
            self.shared = False
        return head_view(a, self.b, self.h)


#: What one call of a mask's ``tile`` costs besides its pairs, in pairs: a call's fixed
#: cost is worth tens of thousands of pairs (a union with global tokens).
_CALL = 1 << 16


#: Pairs of a block without a full tile above which the block form on a finer grid is
#: read first, so that the mask's pairs are evaluated only where it leaves them partial
#: (rows and columns of global tokens cross whole rows of mask).
_REFINE = 1 << 16
#: The finer grid's rows and keys, as fractions of the call's grid.
_FINER = (8, 4)


def _block(mask: UnitMask, states: Any, edges: Any, k0: int, k1: int) -> list[Block]:
    """Keys ``k0:k1`` against the rows of tiles ``states`` (its columns, starting at
    ``edges``): one block, masked over each run of rows and columns of tiles that are
    not full. Where none is, the pairs the mask allows are found first, and the blocks
    cut to them (:func:`_allowed_only`)."""
    step = mask.p.blocks.block_k
    r0, r1 = int(edges[0]), int(edges[-1])
    masked = states != FULL
    if not masked.any():
        return [(k0, k1, r0, r1, [])]
    if masked.all():
        return _allowed_only(mask, edges, k0, k1, step, k1 - k0)
    rects = []  # (first key, last key, first row, last row) of tiles that are not full
    for u0, u1 in runs_of(masked.any(axis=0)):
        s0, s1 = max(k0, (k0 // step + u0) * step), min(k1, (k0 // step + u1) * step)
        rects += [(s0, s1, int(edges[i0]), int(edges[i1]))
                  for i0, i1 in runs_of(masked[:, u0:u1].any(axis=1))]
    runs = _evaluated(mask, rects)  # (first key, first row, allowed)
    # keys at either end that no row may see are left out (a tile's width past the edge)
    s0, a0, allowed = runs[-1]
    if s0 + allowed.shape[1] == k1 and a0 == r0 and len(allowed) == r1 - r0:
        keys = np.flatnonzero(allowed.any(axis=0))
        runs[-1] = (s0, a0, allowed[:, :int(keys[-1]) + 1 if keys.size else 0])
        k1 = s0 + runs[-1][2].shape[1]
    s0, a0, allowed = runs[0]
    if s0 == k0 and a0 == r0 and len(allowed) == r1 - r0 and k1 > k0:
        keys = np.flatnonzero(allowed.any(axis=0))
        skip = int(keys[0]) if keys.size else allowed.shape[1]
        runs[0] = (s0 + skip, a0, allowed[:, skip:])
        k0 += skip
    if k1 <= k0:
        return []
    return [(k0, k1, r0, r1, [(s0 - k0, a0 - r0, _hidden(allowed)) for s0, a0, allowed in runs
                              if allowed.size and not allowed.all()])]


def _evaluated(mask: UnitMask, rects: list[tuple[int, int, int, int]]) -> list[Any]:
    """``(first key, first row, allowed)`` of each of ``rects``, from one call of the
    mask's ``tile`` over all of them where that evaluates fewer pairs more than it saves
    calls, each worth :data:`_CALL` pairs."""
    s0, s1 = min(r[0] for r in rects), max(r[1] for r in rects)
    a0, a1 = min(r[2] for r in rects), max(r[3] for r in rects)
    extra = (s1 - s0) * (a1 - a0) - sum((z - a) * (y - x) for a, z, x, y in rects)
    if len(rects) == 1 or extra > _CALL * (len(rects) - 1):
        return [(a, x, mask.allowed(x, y, a, z)) for a, z, x, y in rects]
    allowed = mask.allowed(a0, a1, s0, s1)
    return [(a, x, allowed[x - a0:y - a0, a - s0:z - s0]) for a, z, x, y in rects]


def _allowed_only(mask: UnitMask, edges: Any, k0: int, k1: int, width: int,
                  cut: int) -> list[Block]:
    """Blocks of at most ``cut`` keys over the pairs the mask allows among keys
    ``k0:k1`` and the rows of tiles from ``edges`` (tiles ``width`` keys wide), where
    tiles are not full: rows of tiles that see the same tiles together (a global
    token's row sees them all, the others one of them), each cut to the pairs it
    allows (:func:`_exact`). A large one is read on a finer grid first
    (:func:`_refined`)."""
    r0, r1 = int(edges[0]), int(edges[-1])
    if (r1 - r0) * (k1 - k0) > _REFINE:
        rows = max(1, mask.p.blocks.block_q // _FINER[0])
        found = mask.states(r0, r1, k0, k1, rows, max(1, width // _FINER[1]))
        if found is not None:
            return _refined(mask, *found, cut)
    allowed = mask.allowed(r0, r1, k0, k1)
    key_edges = np.unique(np.clip(np.arange(k0 // width * width, k1 + width, width), k0, k1))
    seen = np.logical_or.reduceat(allowed, edges[:-1] - r0, axis=0)  # by row of tiles
    seen = np.logical_or.reduceat(seen, key_edges[:-1] - k0, axis=1)  # and by tile
    blocks: list[Block] = []
    for i0, i1 in alike(seen):
        a0, a1 = int(edges[i0]) - r0, int(edges[i1]) - r0
        blocks += _exact(k0, r0 + a0, allowed[a0:a1], cut)
    return blocks


def _refined(mask: UnitMask, states: Any, row_edges: Any, key_edges: Any,
             cut: int) -> list[Block]:
    """Blocks of at most ``cut`` keys over the tiles of a finer grid (``states``, on
    ``row_edges`` by ``key_edges``) that are not hidden: its rows of tiles that see the
    same tiles together, full ones as they are, the others cut to the pairs they
    allow."""
    visible = states != HIDDEN
    blocks: list[Block] = []
    for i0, i1 in alike(visible):
        a0, a1 = int(row_edges[i0]), int(row_edges[i1])
        for j0, j1 in runs_of(visible[i0]):
            s0, s1 = int(key_edges[j0]), int(key_edges[j1])
            if (states[i0:i1, j0:j1] == FULL).all():
                blocks += [(k, min(s1, k + cut), a0, a1, []) for k in range(s0, s1, cut)]
            else:
                blocks += _exact(s0, a0, mask.allowed(a0, a1, s0, s1), cut)
    return blocks


def _exact(k0: int, r0: int, allowed: Any, cut: int) -> list[Block]:
    """Blocks of at most ``cut`` keys over the pairs ``allowed`` (rows from ``r0``, keys
    from ``k0``) allows: cut where keys, then rows, see none of them, and masked where
    not every pair is allowed."""
    blocks: list[Block] = []
    for a, z in runs_of(allowed.any(axis=0)):
        for c in range(a, z, cut):
            part = allowed[:, c:min(z, c + cut)]
            for i, j in runs_of(part.any(axis=1)):
                piece = part[i:j]
                blocks.append((k0 + c, k0 + c + piece.shape[1], r0 + i, r0 + j,
                               [] if piece.all() else [(0, 0, _hidden(piece))]))
    return blocks


def _trimmed(blocks: list[Block], n: int) -> UnitBlocks:
    """The plan of ``blocks`` over ``n`` rows, cut to the rows that attend some key."""
    seen = np.zeros(n, bool)
    for k0, k1, r0, r1, masks in blocks:
        hidden = np.zeros(r1 - r0, np.int64)  # entries hidden in each row (masks are disjoint)
        for _, row, mask in masks:
            hidden[row:row + len(mask)] += mask.sum(axis=1)
        seen[r0:r1] |= hidden < k1 - k0
    rows = np.flatnonzero(seen)
    if not rows.size:
        return UnitBlocks([], 0, 0)
    first, end = int(rows[0]), int(rows[-1]) + 1
    if (first, end) != (0, n):
        blocks = [_cut(block, first, end) for block in blocks
                  if block[2] < end and block[3] > first]
    return UnitBlocks(blocks, first, end)


def _cut(block: Block, first: int, end: int) -> Block:
    """``block`` without its rows outside ``first:end``."""
    k0, k1, r0, r1, masks = block
    c0, c1 = max(r0, first), min(r1, end)
    if (c0, c1) == (r0, r1):
        return block
    kept = []
    for key, row, hidden in masks:
        a0, a1 = max(r0 + row, c0), min(r0 + row + len(hidden), c1)
        if a1 > a0:
            kept.append((key, a0 - c0, hidden[a0 - r0 - row:a1 - r0 - row]))
    return (k0, k1, c0, c1, kept)
def _hidden(allowed: Any) -> Any:
    """The entries ``allowed`` hides, as a new C-ordered array."""
    return np.logical_not(allowed)


def alike(visible: Any) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of rows of ``visible`` that see the same columns,
    some of them."""
    some = visible.any(axis=1)
    cuts = [0, *(np.flatnonzero((visible[1:] != visible[:-1]).any(axis=1)) + 1).tolist(),
            len(visible)]
    return [(a, z) for a, z in itertools.pairwise(cuts) if some[a]]


def runs_of(flags: Any) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of True in ``flags``."""
    if len(flags) > 64:
        cuts = np.flatnonzero(np.diff(np.concatenate([[False], flags, [False]]))).tolist()
        return list(zip(cuts[::2], cuts[1::2], strict=True))
    runs, start = [], None  # few flags: Python's loop is faster than NumPy's calls
    for i, flag in enumerate(flags.tolist()):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(flags)))
    return runs


