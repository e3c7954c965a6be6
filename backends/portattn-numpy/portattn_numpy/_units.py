"""A call's plan as the loops read it: the units of work, each with the blocks it
computes, and the plan that holds them.

``_plan`` makes a plan once per call, on the calling thread; the loops (``_tiles``,
``_diagonal``, ``_stacked``, run by ``_run``) only read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from ._config import Config
    from ._loops import Loops
    from ._memo import CallPlans
    from ._problem import Problem

__all__ = ["KEY_ROW_SCORES", "Block", "Plan", "Unit", "UnitBlocks", "pack", "work"]


Block = tuple[int, int, int, int, list[Any]]
"""``(k0, k1, r0, r1, masks)``: keys ``k0:k1`` against a unit's rows ``r0:r1``, with
``masks`` the entries to hide: ``(key offset, row offset, hidden)``, ``hidden`` queries
by keys, True where masked (``_blocks`` plans them)."""


@dataclass(frozen=True)
class UnitBlocks:
    """What one unit computes, rows counted from its first row."""

    blocks: list[Block]
    """In key order; none when the unit attends nothing."""
    first: int
    end: int
    """Rows ``first:end`` attend some key; the others keep output 0 and lse ``-inf``
    (rows between them that attend nothing are left to the careful way)."""
    squares: int = 0
    """Diagonal squares from row 0 (``_diagonal``): rows ``0:squares*size`` are
    computed in stacked products before ``blocks``; 0 for units of tiles."""

    @cached_property
    def nbytes(self) -> int:
        """About what the plan holds: its masks' entries and a tuple's worth per block
        and mask (counted once per plan, where a walk of every object would cost as
        much as planning a fresh mask)."""
        masks = [hidden.nbytes for *_, found in self.blocks for _, _, hidden in found]
        return sum(masks) + _TUPLE_BYTES * (len(self.blocks) + len(masks))

    @cached_property
    def packed(self) -> tuple[Any, Any, Any]:
        """The blocks as the compiled loops read them (:func:`pack`), made once."""
        return pack(self.blocks)


#: A block's or mask's tuple and the integers in it, about.
_TUPLE_BYTES = 200


class Unit(NamedTuple):
    """Query rows ``q0:q1`` of ``heads`` heads from ``head`` of one batch element against
    keys ``lo:hi``, and what it computes (``blocks``: None for stacked heads, computed
    whole)."""

    batch: tuple[int, ...]
    head: int
    q0: int
    q1: int
    lo: int
    hi: int
    heads: int = 1
    blocks: UnitBlocks | None = None


@dataclass(frozen=True)
class Plan:
    """One call, planned: every decision the loops follow, made before they start."""

    problem: Problem
    loops: Loops
    strategy: Any
    """The way chosen (``_strategy``: ``Tiles``, ``Along`` or ``Stacked``), with what its
    loop reads; the careful way's plan keeps the strategy it redoes."""
    units: list[Unit]
    """Costliest first."""
    careful: bool
    """Whether the units are tiles redone the careful way (``_plan.careful``)."""
    config: Config
    plans: CallPlans
    """The plans of units this call made or found, kept for its careful way."""


def pack(blocks: list[Block]) -> tuple[Any, Any, Any]:
    """``(spans, masks, hidden)``: ``blocks`` as the compiled loops read them. ``spans``
    holds ``(k0, k1, r0, r1)`` rows; ``masks`` a row ``(block, key offset, row offset,
    keys, rows, start)`` for each mask, in block order, whose entries (queries by keys)
    start at ``hidden[start]``."""
    spans = np.array([block[:4] for block in blocks], np.int64).reshape(-1, 4)
    table, parts, start = [], [], 0
    for i, (*_, masks) in enumerate(blocks):
        for key, row, hidden in masks:
            table.append((i, key, row, hidden.shape[1], hidden.shape[0], start))
            parts.append(hidden.ravel())
            start += hidden.size
    return (spans, np.array(table, np.int64).reshape(-1, 6),
            np.concatenate(parts) if parts else np.zeros(0, bool))


#: Reading one key's and value's rows costs about as much as this many scores: a
#: decode step has few scores but a whole cache to read. (Set so that a decode step over
#: a long cache of wide heads is shared by two threads, and one of half the bytes is not.)
KEY_ROW_SCORES = 8
#: Work is counted in scores at head dim 64 (``D + Dv = 128``).
_WIDTH = 128


def work(heads: int, rows: int, keys: int, width: int) -> int:
    """What ``heads`` heads of ``rows`` queries against ``keys`` keys cost, in scores
    at head dim 64 (``width``: ``D + Dv`` of the call)."""
    return heads * keys * (rows + KEY_ROW_SCORES) * width // _WIDTH
