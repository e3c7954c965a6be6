"""Which keys each row of a unit meets, and which of those entries to mask.

A unit's plan comes from the mask's block form on the call's grid (``Problem.blocks``:
``Config.mask_step`` rows by ``Config.mask_chunk`` keys, each tile hidden, full or
partial), read where the unit's batch element and head read it:

* consecutive key columns that the same rows of tiles see become blocks (``(key
  range, row range)``, at most ``block_k`` keys), so blocks follow a staircase, a
  window or the documents of a packed row instead of the unit's bounding box; rows of
  tiles that see a block's columns otherwise get blocks of their own, so no block
  holds a hidden tile;
* rows of tiles that see nearly every column partially (a global token's row) are
  planned as rows of their own, over all their keys;
* within a block only the runs of tiles that are not full get an elementwise mask,
  from the mask's ``tile`` (``_mask_tiles``); where no tile is full, the blocks are
  cut to the pairs the mask allows, read on a finer grid first when large (a global
  token's column crosses whole rows of tiles);
* rows at either end of the unit that attend nothing are left out.

Plans depend on the unit's rows and the states it reads: heads and batch elements that
read the same states share them, and so do later calls of a mask of the same content key
(``CallPlans.shared``, see ``Mask.content_key``). Each is made once: a thread that needs
a plan another is making waits for it (the calling thread makes them ahead of the
others, ``Tiles.prepare``).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import FULL, HIDDEN, PARTIAL

from ._mask_tiles import UnitMask
from ._memo import Store
from ._scores import pack
from ._units import lead_index, unit_states

if TYPE_CHECKING:
    from ._memo import CallPlans
    from ._problem import Problem
    from ._units import Block

__all__ = ["UnitBlocks", "unit_blocks"]


@dataclass(frozen=True)
class UnitBlocks:
    """What one unit computes, rows counted from its first row."""

    blocks: list[Block]
    """In key order; none when the unit attends nothing."""
    first: int
    end: int
    """Rows ``first:end`` attend some key; the others keep output 0 and lse ``-inf``
    (rows between them that attend nothing are left to the careful way)."""

    @cached_property
    def packed(self) -> tuple[Any, Any, Any]:
        """The blocks as the compiled loops read them (``_scores.pack``), made once."""
        return pack(self.blocks)


#: Plans of masks with a content key, by shape and settings: shared by later calls.
_shared_plans: Store[Any] = Store("blocks of units")
#: Stored where a plan read a mask tile that varies where the states do not: each
#: batch element and head then keeps its own.
_PER_HEAD = object()


def unit_blocks(p: Problem, plans: CallPlans, b: tuple[int, ...], h: int, q0: int,
                q1: int) -> UnitBlocks:
    """The blocks of batch element ``b``, head ``h``, rows ``q0:q1``: planned here, or
    by the thread already planning them (then waited for); kept in ``plans``."""
    lead = () if p.blocks is None else lead_index(p.blocks.states, b, h)
    slot = (lead, q0, q1)
    found = _recall(plans, slot)
    if found is _PER_HEAD:
        slot = ("head", *b, h, q0, q1)
        found = _recall(plans, slot)
    if found is not None:
        return found
    with plans.lock:
        claimed = plans.local.get(("planning", slot))
        if claimed is None:
            claimed = plans.local["planning", slot] = threading.Event()
            mine = True
        else:
            mine = False
    if not mine:
        claimed.wait()
        return unit_blocks(p, plans, b, h, q0, q1)
    try:
        mask = UnitMask(p, plans, b, h, q0)
        found = _plan(p, mask, lead, q0, q1)
        if not mask.shared:
            _keep(plans, slot, _PER_HEAD)
        _keep(plans, slot if mask.shared else ("head", *b, h, q0, q1), found)
    except BaseException:
        del plans.local["planning", slot]  # whoever waits plans it again, and meets the error
        raise
    finally:
        claimed.set()
    return found


def _recall(plans: CallPlans, key: tuple) -> Any:
    if plans.shared is not None:
        return _shared_plans.find((plans.shared, *key))
    return plans.local.get(key)


def _keep(plans: CallPlans, key: tuple, value: Any) -> None:
    if plans.shared is not None:
        _shared_plans.put((plans.shared, *key), value)
    else:
        plans.local[key] = value


def _hidden(allowed: Any) -> Any:
    """The entries ``allowed`` hides, as a new C-ordered array."""
    return np.logical_not(allowed)


def _plan(p: Problem, mask: UnitMask, lead: tuple[int, ...], q0: int, q1: int) -> UnitBlocks:
    n = q1 - q0
    if p.blocks is None:
        return UnitBlocks([(k0, min(p.kv_len, k0 + p.block_k), 0, n, [])
                           for k0 in range(0, p.kv_len, p.block_k)], 0, n)
    states, edges = unit_states(p, lead, q0, q1)
    visible = states != HIDDEN
    columns = np.flatnonzero(visible.any(axis=0))
    if not columns.size:
        return UnitBlocks([], 0, 0)
    step, blocks = p.blocks.block_k, []
    # Rows of tiles that see nearly every column, partially (a global token's row), are
    # planned as rows of their own, over all their keys; the others by columns.
    seen = visible[:, columns]
    wide = (seen.mean(axis=1) >= _WIDE) & (
        (states[:, columns] == PARTIAL).sum(axis=1) >= _WIDE * seen.sum(axis=1))
    if wide.any():
        lo, hi = int(columns[0]) * step, min(p.kv_len, (int(columns[-1]) + 1) * step)
        for i0, i1 in _runs_of(wide):
            blocks += _allowed_only(mask, edges[i0:i1 + 1], lo, hi, step, p.block_k)
        states = np.where(wide[:, None], np.int8(HIDDEN), states)
        visible = states != HIDDEN
        columns = np.flatnonzero(visible.any(axis=0))
        if not columns.size:
            return _trimmed(blocks, n)
    first = visible[:, columns].argmax(axis=0)
    last = len(states) - 1 - visible[::-1, columns].argmax(axis=0)
    # a new block where a column is skipped or other rows of tiles see it
    cuts = np.flatnonzero((np.diff(columns) != 1) | (np.diff(first) != 0)
                          | (np.diff(last) != 0)) + 1
    for start, stop in itertools.pairwise([0, *cuts.tolist(), len(columns)]):
        top, bottom = int(first[start]), int(last[start]) + 1  # its rows of tiles
        lo, hi = int(columns[start]) * step, min(p.kv_len, (int(columns[stop - 1]) + 1) * step)
        group = states[top:bottom, int(columns[start]):int(columns[stop - 1]) + 1]
        if not (group == FULL).any():  # no tile full: the pairs it allows, found at once
            for i0, i1 in _runs_of((group != HIDDEN).any(axis=1)):
                blocks += _allowed_only(mask, edges[top + i0:top + i1 + 1], lo, hi, step,
                                        p.block_k)
            continue
        for k0 in range(lo, hi, p.block_k):
            k1 = min(hi, k0 + p.block_k)
            part = states[top:bottom, k0 // step:-(-k1 // step)]
            # rows of tiles that see these keys otherwise make blocks of their own, so
            # that no block holds a hidden tile (and two far rows of global tokens none
            # of the rows between them)
            for i0, i1 in _alike(part != HIDDEN):
                blocks += _block(p, mask, part[i0:i1], edges[top + i0:top + i1 + 1], k0, k1)
    return _trimmed(blocks, n)


def _alike(visible: Any) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of rows of ``visible`` that see the same columns,
    some of them."""
    some = visible.any(axis=1)
    cuts = [0, *(np.flatnonzero((visible[1:] != visible[:-1]).any(axis=1)) + 1).tolist(),
            len(visible)]
    return [(a, z) for a, z in itertools.pairwise(cuts) if some[a]]


def _runs_of(flags: Any) -> list[tuple[int, int]]:
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


def _block(p: Problem, mask: UnitMask, states: Any, edges: Any, k0: int,
           k1: int) -> list[Block]:
    """Keys ``k0:k1`` against the rows of tiles ``states`` (its columns, starting at
    ``edges``): one block, masked over each run of rows and columns of tiles that are
    not full. Where none is, the pairs the mask allows are found first, and the blocks
    cut to them (:func:`_allowed_only`)."""
    step = p.blocks.block_k
    r0, r1 = int(edges[0]), int(edges[-1])
    masked = states != FULL
    if not masked.any():
        return [(k0, k1, r0, r1, [])]
    if masked.all():
        return _allowed_only(mask, edges, k0, k1, step, k1 - k0)
    rects = []  # (first key, last key, first row, last row) of tiles that are not full
    for u0, u1 in _runs_of(masked.any(axis=0)):
        s0, s1 = max(k0, (k0 // step + u0) * step), min(k1, (k0 // step + u1) * step)
        rects += [(s0, s1, int(edges[i0]), int(edges[i1]))
                  for i0, i1 in _runs_of(masked[:, u0:u1].any(axis=1))]
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


#: Share of the columns a row of tiles must see, and of those it must see partially, to
#: be planned as a row of its own.
_WIDE = 0.75
#: What one call of a mask's ``tile`` costs besides its pairs, in pairs: a call's fixed
#: cost is worth tens of thousands of pairs (a union with global tokens).
_CALL = 1 << 16


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


#: Pairs of a block without a full tile above which the block form on a finer grid is
#: read first, so that the mask's pairs are evaluated only where it leaves them partial
#: (rows and columns of global tokens cross whole rows of mask).
_REFINE = 1 << 16
#: The finer grid's rows and keys, as fractions of the call's grid.
_FINER = (8, 4)


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
    for i0, i1 in _alike(seen):
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
    for i0, i1 in _alike(visible):
        a0, a1 = int(row_edges[i0]), int(row_edges[i1])
        for j0, j1 in _runs_of(visible[i0]):
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
    for a, z in _runs_of(allowed.any(axis=0)):
        for c in range(a, z, cut):
            part = allowed[:, c:min(z, c + cut)]
            for i, j in _runs_of(part.any(axis=1)):
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
