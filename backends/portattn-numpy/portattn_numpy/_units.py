"""Units: ``(batch index, head, q0, q1, lo, hi)``, with the keys their rows reach.

The structured mask decides that range before any arithmetic: causal and
sliding-window masks through ``key_range``, key and query lengths by reading the
(small) length arrays. Units with nothing to attend are never created; their rows keep
output 0 and lse ``-inf``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._problem import Problem, Unit

__all__ = ["row_ranges", "units_for"]


def row_ranges(rows: int, step: int, square: int = 1) -> list[tuple[int, int]]:
    """``rows`` cut into ranges of ``step`` rows, each starting on a whole ``square``;
    rows past the last whole square join the last range."""
    whole = rows // square * square
    ranges = [(q0, min(whole, q0 + step)) for q0 in range(0, whole, step)]
    if whole < rows:
        ranges[-1:] = [(ranges[-1][0] if ranges else 0, rows)]
    return ranges


def units_for(p: Problem, b: tuple[int, ...], heads: Iterable[int],
              ranges: Iterable[tuple[int, int]]) -> list[Unit]:
    """Units of ``heads`` of batch element ``b`` over the row ``ranges``, each with the
    keys its rows can reach; rows past the query length and keys past the key length
    are left out, and so are units with nothing to attend."""
    rows = p.q_len if p.query_len is None else int(p.query_len[b])
    keys = p.kv_len if p.key_len is None else int(p.key_len[b])
    heads = list(heads)
    units: list[Unit] = []
    for q0, q1 in ranges:
        q1 = min(q1, rows)
        if q1 <= q0:
            continue
        lo, hi = (0, p.kv_len) if p.positional is None else p.positional.key_range(
            q0, q1, p.q_len, p.kv_len)
        if min(hi, keys) > lo:
            units += [(b, h, q0, q1, lo, min(hi, keys)) for h in heads]
    return units
