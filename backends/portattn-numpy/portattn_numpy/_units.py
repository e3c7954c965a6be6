"""Units, the pieces of work a call is cut into, and the keys their rows reach.

The mask's block form (``Problem.blocks``: which tiles of a fine grid are hidden, full
or partial, per batch element and head where the mask varies) decides that range
before any arithmetic: a unit keeps the rows of its query tile that see some tile, and
``lo:hi`` bounds the keys those rows see. Units with nothing to attend are never
created; their rows keep output 0 and lse ``-inf``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from portattn.masks import HIDDEN

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._problem import Problem

__all__ = ["KEY_ROW_SCORES", "Block", "Unit", "lead_index", "row_ranges", "units_for",
           "unit_states", "work"]


class Unit(NamedTuple):
    """Query rows ``q0:q1`` of one head of one batch element against keys ``lo:hi``
    (for stacked heads, ``head`` is the first of the run)."""

    batch: tuple[int, ...]
    head: int
    q0: int
    q1: int
    lo: int
    hi: int


Block = tuple[int, int, int, int, list[Any]]
"""``(k0, k1, r0, r1, masks)``: keys ``k0:k1`` against a unit's rows ``r0:r1``, with
``masks`` the entries to hide: ``(key offset, row offset, hidden)``, ``hidden`` queries
by keys, True where masked (``_blocks`` plans them)."""

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


def row_ranges(rows: int, step: int, square: int = 1) -> list[tuple[int, int]]:
    """``rows`` cut into ranges of ``step`` rows, each starting on a whole ``square``;
    rows past the last whole square join the last range."""
    whole = rows // square * square
    ranges = [(q0, min(whole, q0 + step)) for q0 in range(0, whole, step)]
    if whole < rows:
        ranges[-1:] = [(ranges[-1][0] if ranges else 0, rows)]
    return ranges


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
