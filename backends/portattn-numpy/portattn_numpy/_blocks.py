"""The units of tiles a call is cut into, the rows and keys each reaches, and which
keys each of its rows meets, in blocks, with the entries to mask.

The block form decides a unit's reach before any arithmetic: a unit keeps the rows of
its query tile that see some tile, and ``lo:hi`` bounds the keys those rows see; units
with nothing to attend are never created, and their rows keep output 0 and lse
``-inf`` (:func:`units_for`).

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
  from the mask's ``tile``; where no tile is full, the blocks are cut to the pairs the
  mask allows, read on a finer grid first when large (a global token's column crosses
  whole rows of tiles): ``_pairs`` reads the mask there, once this module has laid out
  the regions of tiles, in key order;
* rows at either end of the unit that attend nothing are left out.

Plans depend on the unit's rows and the states it reads: heads and batch elements that
read the same states share them, and so do later calls of a mask of the same content key
(``CallPlans.shared``, see ``Mask.content_key``). Each is made once, by the calling
thread while it plans the call (``_plan``), before any loop runs.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import FULL, HIDDEN, PARTIAL

from ._pairs import alike, blocks_of, runs_of
from ._spans import span_blocks
from ._units import Unit, UnitBlocks

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._memo import CallPlans
    from ._pairs import Region
    from ._problem import Problem

__all__ = ["lead_index", "row_ranges", "tile_units", "unit_blocks", "unit_states", "units_for"]


#: Stored where a plan read a mask tile that varies where the states do not: each
#: batch element and head then keeps its own.
_PER_HEAD = object()
#: Share of the columns a row of tiles must see, and of those it must see partially, to
#: be planned as a row of its own.
_WIDE = 0.75


def tile_units(p: Problem, plans: CallPlans, b: tuple[int, ...], heads: Iterable[int],
               rows: Iterable[tuple[int, int]]) -> list[Unit]:
    """Units of ``heads`` of batch element ``b`` over the query tiles ``rows``, narrowed
    to what they reach (:func:`units_for`), each with its blocks (:func:`unit_blocks`)."""
    return [u._replace(blocks=unit_blocks(p, plans, *u[:4]))
            for u in units_for(p, b, heads, rows)]


def _reach(p: Problem, lead: tuple[int, ...], q0: int,
           q1: int) -> tuple[int, int, int, int] | None:
    """``(q0, q1, lo, hi)``: the rows of ``q0:q1`` that see some tile, and the keys they
    see; None when they see none."""
    states, edges = unit_states(p, lead, q0, q1)
    visible = states != HIDDEN
    rows, keys = np.flatnonzero(visible.any(axis=1)), np.flatnonzero(visible.any(axis=0))
    if not rows.size:
        return None
    step = p.blocks.block_k
    return (q0 + int(edges[rows[0]]), q0 + int(edges[rows[-1] + 1]), int(keys[0]) * step,
            min(p.kv_len, (int(keys[-1]) + 1) * step))


def units_for(p: Problem, b: tuple[int, ...], heads: Iterable[int],
              ranges: Iterable[tuple[int, int]]) -> list[Unit]:
    """Units of ``heads`` of batch element ``b`` over the row ``ranges``, each narrowed to
    the rows that see some key and to the keys they see; units with nothing to attend
    are left out."""
    heads = list(heads)
    units: list[Unit] = []
    if p.blocks is None:
        for q0, q1 in ranges:
            if q1 > q0 and p.kv_len:
                units += [Unit(b, h, q0, q1, 0, p.kv_len) for h in heads]
        return units
    by_lead: dict[tuple[int, ...], list[int]] = {}
    for h in heads:  # heads that read the same states share their reach
        by_lead.setdefault(lead_index(p.blocks.states, b, h), []).append(h)
    for q0, q1 in ranges:
        if q1 <= q0:
            continue
        for lead, shared in by_lead.items():
            reach = _reach(p, lead, q0, q1)
            if reach is not None:
                units += [Unit(b, h, *reach) for h in shared]
    return units


def unit_blocks(p: Problem, plans: CallPlans, b: tuple[int, ...], h: int, q0: int,
                q1: int) -> UnitBlocks:
    """The blocks of batch element ``b``, head ``h``, rows ``q0:q1``: found in ``plans``,
    else planned here and kept there."""
    lead = () if p.blocks is None else lead_index(p.blocks.states, b, h)
    slot = (lead, q0, q1)
    found = plans.find(slot)
    if found is _PER_HEAD:
        slot = ("head", *b, h, q0, q1)
        found = plans.find(slot)
    if found is not None:
        return found
    n = q1 - q0
    if p.blocks is None:
        found = UnitBlocks([(k0, min(p.kv_len, k0 + p.block_k), 0, n, [])
                            for k0 in range(0, p.kv_len, p.block_k)], 0, n)
        plans.keep(slot, found)
        return found
    found, shared = span_blocks(p, plans, lead, q0, q1), True
    if found is None:
        states, edges = unit_states(p, lead, q0, q1)
        found, shared = blocks_of(p, plans, b, h, q0, _regions(p, states, edges), n)
    if not shared:
        plans.keep(slot, _PER_HEAD)
    plans.keep(slot if shared else ("head", *b, h, q0, q1), found)
    return found


def lead_index(states: Any, b: tuple[int, ...], h: int) -> tuple[int, ...]:
    """Where batch element ``b`` and head ``h`` read the block form's ``states``, whose
    leading axes broadcast against ``(*batch, H)`` (an axis of size 1 is shared)."""
    lead = states.shape[:-2]
    if not lead:
        return ()
    at = (*b, h)[-len(lead):]
    return tuple(0 if size == 1 else i for i, size in zip(at, lead, strict=True))


def unit_states(p: Problem, lead: tuple[int, ...], q0: int, q1: int) -> tuple[Any, Any]:
    """``(states, edges)``: the fine tiles of rows ``q0:q1`` (``(rows, key blocks)``, read
    at ``lead``), and where each row of tiles starts and ends, counted from ``q0``."""
    step = p.blocks.block_q
    a0, a1 = q0 // step, -(-q1 // step)
    edges = np.clip(np.arange(a0, a1 + 1) * step, q0, q1) - q0
    return p.blocks.states[lead][a0:a1], edges


def _regions(p: Problem, states: Any, edges: Any) -> list[Region]:
    """The regions of a unit's tiles (``states``, rows of tiles from ``edges``) that its
    blocks are made of, in key order (see ``_pairs.Region``)."""
    visible = states != HIDDEN
    columns = np.flatnonzero(visible.any(axis=0))
    if not columns.size:
        return []
    step, regions = p.blocks.block_k, []
    # Rows of tiles that see nearly every column, partially (a global token's row), are
    # planned as rows of their own, over all their keys; the others by columns.
    seen = visible[:, columns]
    wide = (seen.mean(axis=1) >= _WIDE) & (
        (states[:, columns] == PARTIAL).sum(axis=1) >= _WIDE * seen.sum(axis=1))
    if wide.any():
        lo, hi = int(columns[0]) * step, min(p.kv_len, (int(columns[-1]) + 1) * step)
        regions += [(edges[i0:i1 + 1], lo, hi, None) for i0, i1 in runs_of(wide)]
        states = np.where(wide[:, None], np.int8(HIDDEN), states)
        visible = states != HIDDEN
        columns = np.flatnonzero(visible.any(axis=0))
        if not columns.size:
            return regions
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
            regions += [(edges[top + i0:top + i1 + 1], lo, hi, None)
                        for i0, i1 in runs_of((group != HIDDEN).any(axis=1))]
            continue
        for k0 in range(lo, hi, p.block_k):
            k1 = min(hi, k0 + p.block_k)
            part = states[top:bottom, k0 // step:-(-k1 // step)]
            # rows of tiles that see these keys otherwise make blocks of their own, so
            # that no block holds a hidden tile (and two far rows of global tokens none
            # of the rows between them)
            regions += [(edges[top + i0:top + i1 + 1], k0, k1, part[i0:i1])
                        for i0, i1 in alike(part != HIDDEN)]
    return regions


def row_ranges(rows: int, step: int, square: int = 1) -> list[tuple[int, int]]:
    """``rows`` cut into ranges of ``step`` rows, each starting on a whole ``square``;
    rows past the last whole square join the last range."""
    whole = rows // square * square
    ranges = [(q0, min(whole, q0 + step)) for q0 in range(0, whole, step)]
    if whole < rows:
        ranges[-1:] = [(ranges[-1][0] if ranges else 0, rows)]
    return ranges
