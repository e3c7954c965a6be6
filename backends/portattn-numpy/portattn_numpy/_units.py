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

__all__ = ["KEY_ROW_SCORES", "row_ranges", "units_for", "work"]

#: Reading one key's and value's rows costs about as much as this many scores: a
#: decode step has few scores but a whole cache to read. (Decode steps over 4096 keys:
#: 8 heads at head dim 128 ran 1.5x faster on two threads than on one, 8 heads at head
#: dim 64, half the bytes, no faster; this value splits the first and not the second.)
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
