"""Masks shaped like a causal one: finding the shape, and planning a unit along it.

Cut the query rows into squares of ``S`` (``Config.mask_step``) rows. Under a causal
mask each whole square attends every key before its own ``S`` by ``S`` diagonal square,
and inside that square the same triangle (when keys run out before the last square,
or the first rows see no key, it does not hold, and tiles are used). A unit of many
squares then computes every diagonal square at once, in one stacked product masked by
one 0/1 tile (``_diagonal``), then the keys before each square. Those come in groups
of squares (``Diagonal.group``): the keys before a group's first square in blocks as
wide as a score tile allows, shared by all its rows, and each later square's keys from
there to its own in a block of its own. Rows past the last whole square follow the
mask in tiles (``_blocks``).

:func:`find` decides from the mask's block form and the tiles of its diagonal squares
whether a call has this shape; what it finds and the plan of each unit are kept across
calls of that shape (``_memo``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import FULL, HIDDEN, block_mask

from ._blocks import unit_blocks
from ._memo import Store
from ._units import UnitBlocks

if TYPE_CHECKING:
    from portattn.masks import Mask

    from ._config import Config
    from ._memo import CallPlans
    from ._problem import Problem
    from ._units import Block

__all__ = ["Diagonal", "along_blocks", "find", "group_rows"]


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


#: Plans of units, by shape: shared by heads and later calls.
_plans: Store[UnitBlocks] = Store("plans of units along the diagonal")


def along_blocks(p: Problem, config: Config, plans: CallPlans, d: Diagonal,
                 b: tuple[int, ...], h: int, q0: int, q1: int) -> UnitBlocks:
    """The squares and blocks of rows ``q0:q1`` (``q0`` a multiple of the square size)
    of batch element ``b``, head ``h``: the same for every batch element and head,
    whose masks have the shape alike."""
    key = (config, p.mask, p.q_len, p.kv_len, p.block_k, d, q0, q1)
    return _plans.get(key, lambda: _along_blocks(p, plans, d, b, h, q0, q1))


def _along_blocks(p: Problem, plans: CallPlans, d: Diagonal, b: tuple[int, ...], h: int,
                  q0: int, q1: int) -> UnitBlocks:
    size, shift = d.size, d.key_shift
    squares = (q1 - q0) // size
    along = squares * size
    blocks: list[Block] = []
    for g0 in range(0, along, d.group * size):
        g1 = min(along, g0 + d.group * size)
        shared = q0 + g0 + shift  # keys before the group's first diagonal square
        blocks += [(k0, min(shared, k0 + d.group_k), g0, g1, [])
                   for k0 in range(0, shared, d.group_k)]
        for r0 in range(g0 + size, g1, size):
            end = q0 + r0 + shift  # the square's own keys start here
            blocks += [(k0, min(end, k0 + d.block_k), r0, r0 + size, [])
                       for k0 in range(shared, end, d.block_k)]
    rows_with_keys = along  # the others keep out 0, lse -inf
    if q0 + along < q1:  # rows past the last full square follow the mask in tiles
        tail = unit_blocks(p, plans, b, h, q0 + along, q1)
        if tail.blocks:
            blocks += [(k0, k1, r0 + along, r1 + along, masks)
                       for k0, k1, r0, r1, masks in tail.blocks]
            rows_with_keys = along + tail.end
    return UnitBlocks(blocks, 0, rows_with_keys, squares)
