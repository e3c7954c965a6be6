"""Strategies: the ways a call is cut into units, and which one a call takes.

Each strategy is a small record made for one call by :func:`choose`, holding what its
loop reads besides the units (``_tiles``, ``_diagonal``, ``_stacked``):

* :class:`Stacked`: small heads, many whole heads to a unit;
* :class:`Along`: causal-shaped masks, runs of squares along the diagonal
  (``_diagonal_shape``);
* :class:`Tiles`: everything else, query tiles against key blocks.

They are tried in that order (``Config.strategies`` can leave some out). Its ``units``
cuts a batch element into units, each with the blocks it computes (``_blocks``,
``_diagonal_shape``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import FULL, HIDDEN

from ._blocks import row_ranges, tile_units, units_for
from ._diagonal_shape import along_blocks, find, group_rows
from ._units import Unit, work

if TYPE_CHECKING:
    from ._config import Config
    from ._diagonal_shape import Diagonal
    from ._loops import Loops
    from ._memo import CallPlans
    from ._problem import Problem

__all__ = ["SHARE", "Along", "Stacked", "Tiles", "choose", "heads_per_unit"]


@dataclass(frozen=True)
class Tiles:
    """Query tiles of ``block_q`` rows, each against the keys its rows reach."""

    rows: tuple[tuple[int, int], ...]
    name = "tiles"

    def units(self, p: Problem, config: Config, plans: CallPlans,
              b: tuple[int, ...]) -> list[Unit]:
        return tile_units(p, plans, b, range(p.query.shape[-3]), self.rows)


@dataclass(frozen=True)
class Along:
    """Units of whole squares of rows along the diagonal (``_diagonal_shape``)."""

    shape: Diagonal
    rows: tuple[tuple[int, int], ...]
    name = "diagonal"

    def units(self, p: Problem, config: Config, plans: CallPlans,
              b: tuple[int, ...]) -> list[Unit]:
        return [u._replace(blocks=along_blocks(p, config, plans, self.shape, *u[:4]))
                for u in units_for(p, b, range(p.query.shape[-3]), self.rows)]


@dataclass(frozen=True)
class Stacked:
    """``kv_heads`` key/value heads (and their query heads) to a unit, whole."""

    kv_heads: int
    keep: Any
    """The whole mask as 0/1 in the scores' dtype and layout (full rank, ``(..., Lk,
    Lq)``: keys by queries), or None."""
    has_keys: Any
    """Which query rows the mask lets see any key (full rank, ``(..., Lq, 1)``), or
    None."""
    name = "stacked"

    def units(self, p: Problem, config: Config, plans: CallPlans,
              b: tuple[int, ...]) -> list[Unit]:
        hq, step = p.query.shape[-3], self.kv_heads * p.group
        return [Unit(b, h, 0, p.q_len, 0, p.kv_len, min(hq, h + step) - h)
                for h in range(0, hq, step)]


def choose(p: Problem, config: Config, loops: Loops, threads: int) -> Tiles | Along | Stacked:
    """The first strategy of ``config.strategies`` that applies (``tiles`` always does)."""
    for name in config.strategies:
        found = _CHOOSERS[name](p, config, loops, threads)
        if found is not None:
            return found
    return _tiles(p, config, loops, threads)


def _tiles(p: Problem, config: Config, loops: Loops, threads: int) -> Tiles:
    return Tiles(tuple(row_ranges(p.q_len, p.block_q)))


def _along(p: Problem, config: Config, loops: Loops, threads: int) -> Along | None:
    """Units along the diagonal where the mask is causal-shaped, holds no arrays and is
    the same for every batch element and head, and there is no bias and no score change
    but one by distance (the same entries for every diagonal square)."""
    if p.bias is not None or p.mask is None or p.mask.arrays:
        return None
    if p.change is not None and not p.change.by_distance:
        return None
    shape = find(p.mask, p.q_len, p.kv_len, p.query.dtype, p.tile_elements,
                 config.mask_step, group_rows(p.tile_elements, config))
    if shape is None:
        return None
    heads = math.prod(p.query.shape[:-2])
    step = _rows_along(p, config, shape, heads=heads, threads=threads)
    return Along(shape, tuple(row_ranges(p.q_len, step, shape.size)))


def _rows_along(p: Problem, config: Config, shape: Diagonal, *, heads: int,
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


#: A head is stacked when its scores fill at most ``1 / SHARE[tiles_compiled,
#: tiles_skip]`` of a tile: less where tiles skip work the mask's block form hides
#: (causal, sliding window, lengths, documents; stacking computes every pair), and less
#: where tiles run their unmasked blocks in one compiled call a unit
#: (``_compiled_blocks``; a mask with no full tile, random dense ones, leaves them none):
#: the shares where tiles and stacking measured about as fast.
SHARE = {(False, False): 4, (False, True): 16, (True, False): 16, (True, True): 32}


def heads_per_unit(q_len: int, kv_len: int, group: int, kv_heads: int, tile_elements: int,
                   *, tiles_skip: bool = False, tiles_compiled: bool = False) -> int:
    """Key/value heads per stacked unit (their query heads come along), or 0 when the
    heads are too large to stack."""
    per_head = q_len * kv_len
    share = SHARE[tiles_compiled, tiles_skip]
    if per_head == 0 or per_head * share > tile_elements:
        return 0
    return max(1, min(kv_heads, tile_elements // (per_head * group)))


def _stacked(p: Problem, config: Config, loops: Loops, threads: int) -> Stacked | None:
    """Whole heads to a unit where they are small enough to stack."""
    hq = p.query.shape[-3]
    if not hq:  # no query heads at all: nothing to stack, and the group size is 0
        return None
    if p.change is not None and not p.change.stackable:
        return None  # stacked heads read every entry of a score change at once
    # tiles skip the tiles the mask hides, and run its full ones compiled where they can
    states = None if p.blocks is None else p.blocks.states
    skips = states is not None and bool((states == HIDDEN).any())
    compiled = loops.compiled is not None and (states is None or bool((states == FULL).any()))
    kv = heads_per_unit(p.q_len, p.kv_len, p.group, hq // p.group, p.tile_elements,
                        tiles_skip=skips, tiles_compiled=compiled)
    if not kv:
        return None
    # fewer heads to a unit where that gives work to threads that would idle
    batch = math.prod(p.query.shape[:-3])
    width = p.query.shape[-1] + p.value.shape[-1]
    busy = min(threads, work(batch * hq, p.q_len, p.kv_len, width)
               // config.min_scores_per_thread)
    units_per_element = math.ceil(busy / max(batch, 1))
    if units_per_element > 1:
        kv = min(kv, math.ceil(hq // p.group / units_per_element))
    allowed = _whole_mask(p)
    if allowed is None:
        return Stacked(kv, None, None)
    # once per call: multiplying by a contiguous 0/1 tile is several times faster than
    # by the transposed boolean mask
    keep = np.ascontiguousarray(allowed.swapaxes(-1, -2), dtype=p.query.dtype)
    return Stacked(kv, keep, allowed.any(axis=-1, keepdims=True))


def _whole_mask(p: Problem) -> Any:
    """The mask over the whole problem, full rank (``(*batch|1, H|1, Lq|1, Lk|1)``)."""
    if p.mask is None:
        return None
    lq, lk = p.q_len, p.kv_len
    allowed = p.mask.tile(np, 0, lq, 0, lk, lq, lk)
    if allowed is None:  # every part covers everything
        return None
    allowed = np.asarray(allowed)
    rank = p.query.ndim
    return allowed.reshape((1,) * (rank - allowed.ndim) + allowed.shape)


_CHOOSERS = {"stacked": _stacked, "diagonal": _along, "tiles": _tiles}
