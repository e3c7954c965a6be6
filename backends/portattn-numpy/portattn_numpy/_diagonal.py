"""Masks shaped like a causal one, computed along the diagonal.

Cut the query rows into squares of ``S`` (``Config.mask_step``) rows. Under a causal
mask each whole square attends every key before its own ``S`` by ``S`` diagonal square,
and inside that square the same triangle (when keys run out before the last square,
or the first rows see no key, it does not hold, and tiles are used). So a unit of many
squares is computed as: every diagonal square at once, in one stacked product masked
by one 0/1 tile, then the keys before each square. Those come in groups of squares
(``Diagonal.group``): the keys before a group's first square in blocks as wide as a
score tile allows, shared by all its rows, and each later square's keys from there to
its own in a block of its own. Compared with tiles that follow the staircase, that is a
few NumPy calls per unit instead of several per square, and masking by a multiply
instead of a scattered copy; with several threads every call also costs a round trip
of the GIL, so the count matters. Compared with a block per square, the shared blocks
are the ``tiles`` strategy's shape: BLAS runs such tall products faster than those of
one square's rows, and packs the keys once for all their rows.

:func:`find` decides from the mask's block form and the tiles of its diagonal squares
whether a call has this shape; what it finds and the plan of each unit are kept across
calls of that shape (``_memo``). Applies to calls without a bias whose mask holds no
arrays and is the same for every batch element and head, and whose heads are not
stacked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import FULL, HIDDEN, block_mask

from ._blocks import unit_blocks
from ._memo import Store
from ._scores import ScoreTile, accumulate_compiled, finish_fast, scores
from ._scratch import take
from ._units import row_ranges, units_for

if TYPE_CHECKING:
    from portattn.masks import Mask

    from ._config import Config
    from ._loops import Loops
    from ._memo import CallPlans
    from ._problem import Problem
    from ._units import Block, Unit

__all__ = ["Along", "Diagonal", "Scratch", "UnitPlan", "find", "group_rows", "plan"]


@dataclass(frozen=True)
class Diagonal:
    """The shape shared by every square of rows: found once per call."""

    size: int
    """Rows (and keys) of a square."""
    squares: int
    """Squares a unit holds at most: their stacked scores fill one tile."""
    block_k: int
    """Keys per block of one square's rows: a block's scores fill one tile."""
    group: int
    """Squares whose earlier keys are computed together (see :func:`group_rows`)."""
    group_k: int
    """Keys per block shared by a group's rows: a block's scores fill one tile."""
    key_shift: int
    """The diagonal square of rows ``a:a+size`` holds keys ``a+key_shift:a+key_shift+size``."""
    keep: Any = field(compare=False, repr=False)
    """``(size, size)`` 0/1 in the query's dtype, keys by queries: which pairs of a
    diagonal square are attended (left out of comparisons: the mask decides it)."""


@dataclass(frozen=True)
class UnitPlan:
    """What one unit computes, rows counted from the unit's first row."""

    squares: int
    """Diagonal squares from row 0: rows ``0:squares*size``."""
    blocks: list[Block]
    """The keys before each square (the rows after the last full square follow the
    mask in tiles: ``_blocks``)."""


@dataclass(frozen=True)
class Along:
    """The ``diagonal`` strategy: units of whole squares of rows."""

    shape: Diagonal
    rows: tuple[tuple[int, int], ...]
    config: Config
    loops: Loops
    plans: CallPlans
    name = "diagonal"

    def units(self, p: Problem, b: tuple[int, ...]) -> list[Unit]:
        return units_for(p, b, range(p.query.shape[-3]), self.rows)

    def heads(self, p: Problem, h: int) -> range:
        return range(h, h + 1)

    def prepare(self, p: Problem, units: list[Unit]) -> None:
        pass  # nothing a unit plans costs more than a lookup after the first call

    def scratch(self, p: Problem) -> Scratch:
        return Scratch(p, self.shape)

    def attend(self, p: Problem, s: Scratch, unit: Unit) -> bool:
        return _attend(p, self, s, *unit)


def plan(p: Problem, config: Config, loops: Loops, plans: CallPlans,
         threads: int) -> Along | None:
    """The strategy for ``p`` when its mask is causal-shaped, else None."""
    if p.bias is not None or p.mask is None or p.mask.arrays:
        return None
    shape = find(p.mask, p.q_len, p.kv_len, p.query.dtype, p.tile_elements,
                 config.mask_step, group_rows(p.tile_elements, config))
    if shape is None:
        return None
    heads = math.prod(p.query.shape[:-2])
    step = _rows_per_unit(p, config, shape, heads=heads, threads=threads)
    return Along(shape, tuple(row_ranges(p.q_len, step, shape.size)), config, loops, plans)


def _rows_per_unit(p: Problem, config: Config, shape: Diagonal, *, heads: int,
                   threads: int) -> int:
    """As many squares as one tile holds (they are computed in one stacked product),
    fewer when the threads need more units.

    These units are coarse and unequal, so threads get twice as many of them as of
    tiles, to finish together; but each keeps ``Config.min_squares`` squares, or its
    few fixed calls would outweigh its work.
    """
    squares = shape.squares
    want_units = math.ceil(2 * config.min_units_per_thread * threads / max(heads, 1))
    if want_units > 1:
        squares = min(squares, max(config.min_squares, p.q_len // shape.size // want_units))
    return squares * shape.size


#: What :func:`find` found, by mask and shape: later calls of that shape reuse it.
_shapes: Store[Diagonal | None] = Store("diagonal shapes")


def find(mask: Mask | None, q_len: int, kv_len: int, dtype: Any, tile_elements: int,
         size: int, rows_per_group: int = 0) -> Diagonal | None:
    """The diagonal shape of ``mask`` (bound to the call) in squares of ``size``, or None
    when some full square does not have it. Squares are grouped by ``rows_per_group``
    rows (at least one)."""
    if mask is None or q_len < size:
        return None
    key = (mask, q_len, kv_len, np.dtype(dtype), tile_elements, size, rows_per_group)
    return _shapes.get(key, lambda: _find(mask, q_len, kv_len, dtype, tile_elements, size,
                                          rows_per_group))


def group_rows(tile_elements: int, config: Config) -> int:
    """Rows of a group of squares: those of a score tile of the widest key block
    (``Config.max_block_k``), at most ``Config.max_block_q``. (Groups of the ``tiles``
    strategy's taller tiles, ``Config.preferred_block_q``, measured no faster.)"""
    return min(config.max_block_q, tile_elements // config.max_block_k)


def _find(mask: Mask, q_len: int, kv_len: int, dtype: Any, tile_elements: int,
          size: int, rows_per_group: int) -> Diagonal | None:
    squares = q_len // size
    first = _same_for_all(mask.tile(np, 0, size, 0, kv_len, q_len, kv_len), size, kv_len)
    if first is None:
        return None
    seen = np.flatnonzero(first.any(axis=0))
    if not seen.size:
        return None
    shift = int(seen[-1]) + 1 - size  # the first square's diagonal square starts here
    if shift < 0 or shift + squares * size > kv_len:
        return None
    # Every square sees every key before its diagonal square and none after it: read on
    # a grid whose key blocks start where each diagonal square does.
    step = math.gcd(size, shift)
    states = block_mask(mask, q_len, kv_len, size, step).states
    if states.ndim != 2:  # the mask differs between batch elements or heads
        return None
    starts = (np.arange(squares)[:, None] * size + shift) // step
    columns = np.arange(states.shape[1])[None, :]
    rows = states[:squares]
    before, after = columns < starts, columns >= starts + size // step
    if not ((rows == FULL) | ~before).all() or not ((rows == HIDDEN) | ~after).all():
        return None
    keep = first[:, shift:shift + size]
    for a in range(size, squares * size, size):  # and the same triangle in each
        square = mask.tile(np, a, a + size, a + shift, a + shift + size, q_len, kv_len)
        square = _same_for_all(square, size, size)
        if square is None or not np.array_equal(square, keep):
            return None
    group = max(1, rows_per_group // size)
    return Diagonal(size, max(1, tile_elements // size**2), max(1, tile_elements // size),
                    group, max(1, tile_elements // (group * size)), shift,
                    np.ascontiguousarray(keep.T, dtype=dtype))


def _same_for_all(tile: Any, rows: int, keys: int) -> Any:
    """``tile`` as ``(rows, keys)``, or None where it differs between batch elements or
    heads."""
    tile = np.asarray(tile)
    if any(size > 1 for size in tile.shape[:-2]):
        return None
    return np.broadcast_to(tile.reshape(tile.shape[-2:]), (rows, keys))


#: Plans of units, by shape: shared by heads, threads and later calls.
_plans: Store[UnitPlan] = Store("plans of units along the diagonal")


def unit_plan(p: Problem, config: Config, d: Diagonal, q0: int, q1: int) -> UnitPlan:
    """The squares and blocks of rows ``q0:q1`` (``q0`` a multiple of the square size)."""
    key = (config, p.mask, p.q_len, p.kv_len, p.block_k, d, q0, q1)
    return _plans.get(key, lambda: _unit_plan(p, d, q0, q1))


def _unit_plan(p: Problem, d: Diagonal, q0: int, q1: int) -> UnitPlan:
    size, shift = d.size, d.key_shift
    squares = (q1 - q0) // size
    blocks: list[Block] = []
    for g0 in range(0, squares * size, d.group * size):
        g1 = min(squares * size, g0 + d.group * size)
        shared = q0 + g0 + shift  # keys before the group's first diagonal square
        blocks += [(k0, min(shared, k0 + d.group_k), g0, g1, [])
                   for k0 in range(0, shared, d.group_k)]
        for r0 in range(g0 + size, g1, size):
            end = q0 + r0 + shift  # the square's own keys start here
            blocks += [(k0, min(end, k0 + d.block_k), r0, r0 + size, [])
                       for k0 in range(shared, end, d.block_k)]
    return UnitPlan(squares, blocks)


class Scratch:
    """One worker's buffers for units along the diagonal, kept for later calls."""

    def __init__(self, p: Problem, d: Diagonal) -> None:
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


def _attend(p: Problem, a: Along, s: Scratch, b: tuple[int, ...], h: int, q0: int,
            q1: int, lo: int, hi: int) -> bool:
    """One unit the fast way (see ``_tiles``); False when it must be redone carefully."""
    d, on_tile, loops = a.shape, a.config.on_tile, a.loops
    unit = unit_plan(p, a.config, d, q0, q1)
    n, along, count = q1 - q0, unit.squares * d.size, unit.squares
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
    loops.exponential(stacked)
    np.multiply(stacked, d.keep, out=stacked)
    np.matmul(stacked.transpose(0, 2, 1), v[start:start + along].reshape(count, d.size, -1),
              out=acc[:along, :-1].reshape(count, d.size, -1))
    np.matmul(s.ones[:d.size], stacked, out=acc[:along, -1].reshape(count, d.size))
    acc[along:] = 0  # rows past the last square start from nothing
    blocks, rows_with_keys = unit.blocks, along  # the others keep out 0, lse -inf
    if q0 + along < q1:  # rows past the last full square follow the mask in tiles
        tail = unit_blocks(p, a.plans, b, h, q0 + along, q1)
        if tail.blocks:
            blocks = blocks + [(k0, k1, r0 + along, r1 + along, masks)
                               for k0, k1, r0, r1, masks in tail.blocks]
            rows_with_keys = along + tail.end
    if loops.compiled is not None and blocks:  # all in one compiled call, masks included
        accumulate_compiled(loops.compiled, on_tile, s.tile, 1.0, q, k, v, acc[:, :-1],
                            acc[:, -1], blocks, first_writes=False, unit=(b, h, q0))
        blocks = []
    for k0, k1, r0, r1, masks in blocks:
        if on_tile is not None:
            on_tile(b, h, q0 + r0, q0 + r1, k0, k1)
        width, part = k1 - k0, s.part[:r1 - r0]
        span, tile = s.tile.scores(width, r1 - r0)
        scores(p, k[k0:k1], q[r0:r1].T, tile, span)
        tile = s.tile.weights(loops, width, r1 - r0, masks, part[:, -1])
        np.matmul(tile.T, v[k0:k1], out=part[:, :-1])
        acc[r0:r1] += part
    filled = acc[:rows_with_keys]
    rows = (*b, h, slice(q0, q0 + rows_with_keys))
    return finish_fast(loops.compiled, filled, filled[:, -1], hi - lo, p.out[rows],
                       None if p.lse is None else p.lse[rows])
