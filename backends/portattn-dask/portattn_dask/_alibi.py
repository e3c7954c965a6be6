"""ALiBi for one block, at the positions of the whole call.

ALiBi adds ``-slope * |p - j|`` to the score of the query at position
``p = i + Lk - Lq`` and key ``j``. A chunk call aligns its own queries bottom-right,
which is the whole call's alignment only when the block's last key sits at its last
query's position ("on the diagonal"). Every other block is exact another way, never by
building its ALiBi as an array:

- every key of the block at or before every query's position (or at or after it):
  ``|p - j|`` splits into a term per key, passed as a bias row ``(Lk',)`` per head, and a
  term per query, a constant of its softmax, added to the block's lse afterwards;
- a block that the diagonal crosses elsewhere is cut in two (:func:`aligned_parts`): the
  part on the diagonal and a part on one side of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BlockAlibi", "aligned_parts", "block_alibi"]

Part = tuple[int, int, int, int]


@dataclass(frozen=True)
class BlockAlibi:
    """What one chunk call gets: ``slopes`` for the chunk kernel to apply itself, or a
    ``bias`` term ``(*b | 1, H, 1, Lk')`` and a ``row`` term ``(*b | 1, H, Lq')`` to add
    to the lse."""

    slopes: Any = None
    bias: Any = None
    row: Any = None


def aligned_parts(q0: int, q1: int, k0: int, k1: int, q_len: int, kv_len: int
                  ) -> tuple[str, tuple[Part, ...]]:
    """The block ``query[q0:q1] x key[k0:k1]`` cut into parts :func:`block_alibi`
    takes, and how their results join: ``"keys"`` (merged, split-KV) or ``"rows"``
    (stacked)."""
    offset = kv_len - q_len  # position of query 0
    last = q1 - 1 + offset  # position of the last query
    if q1 + offset == k1 or k1 - 1 <= q0 + offset or k0 >= last:
        return "keys", ((q0, q1, k0, k1),)
    if last < k1 - 1:  # keys past the last query's position: they form the second part
        return "keys", ((q0, q1, k0, last + 1), (q0, q1, last + 1, k1))
    cut = k1 - offset  # queries from here on sit after every key
    return "rows", ((q0, cut, k0, k1), (cut, q1, k0, k1))


def block_alibi(xp: Any, slopes: Any, part: Part, q_len: int, kv_len: int, dtype: Any,
                device: Any) -> BlockAlibi:
    """ALiBi of one part of :func:`aligned_parts`; ``slopes`` is ``(*b | 1, H)``."""
    q0, q1, k0, k1 = part
    offset = kv_len - q_len
    if q1 + offset == k1:  # the chunk's own alignment is the call's
        return BlockAlibi(slopes=slopes)
    slope = xp.astype(slopes, dtype)[..., None, None]
    row_slope = slope[..., 0]
    positions = xp.arange(q0 + offset, q1 + offset, dtype=dtype, device=device)
    keys = xp.arange(k0, k1, dtype=dtype, device=device)
    last = k1 - 1
    if last <= q0 + offset:  # |p - j| = (p - last) + (last - j)
        return BlockAlibi(bias=-slope * (last - keys), row=-row_slope * (positions - last))
    if k0 >= q1 - 1 + offset:  # |p - j| = (j - k0) + (k0 - p)
        return BlockAlibi(bias=-slope * (keys - k0), row=-row_slope * (k0 - positions))
    msg = f"block {part} crosses the diagonal: cut it with aligned_parts() first"
    raise ValueError(msg)
