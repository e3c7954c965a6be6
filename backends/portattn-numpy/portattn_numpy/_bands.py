"""Running a call whose score change's entries are made a band of query rows at a time
(``_changes.Shift.banded``): the units of each query tile together, after the entries
of the rows and keys they read are made, on the calling thread.

A change gives the entries of a range of queries and keys for every batch element and
head at once; every unit of a query tile (each batch element's and head's, and the
careful way's tiles of them) reads its own from one such range, so each entry is made
once, and the memory of one band at a time is held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._problem import Problem
    from ._units import Unit

__all__ = ["bands"]


def bands(p: Problem, units: list[Unit]) -> list[tuple[tuple[int, int, int, int] | None,
                                                        list[Unit]]]:
    """``units`` by query tile (``Problem.block_q`` rows), in row order, each group with
    ``(q0, q1, k0, k1)``: the queries and keys its blocks read (None where they read
    none). Within a group the units keep their order."""
    groups: dict[int, list[Unit]] = {}
    for unit in units:
        groups.setdefault(unit.q0 // p.block_q, []).append(unit)
    found = []
    for _, group in sorted(groups.items()):
        spans = [(u.q0 + r0, u.q0 + r1, k0, k1) for u in group
                 for k0, k1, r0, r1, _ in (u.blocks.blocks if u.blocks else ())]
        corner = None if not spans else (min(s[0] for s in spans), max(s[1] for s in spans),
                                         min(s[2] for s in spans), max(s[3] for s in spans))
        found.append((corner, group))
    return found
