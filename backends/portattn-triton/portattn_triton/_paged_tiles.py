"""The host plan of a paged call's programs: query tiles, their key ranges and splits.

Each sequence's queries are cut into tiles of ``tile_queries`` queries, and the query
heads of a K/V head's group into chunks of ``tile_heads`` (one chunk unless the group
is taller than a tile), so that a tile packs ``tile_heads x tile_queries <= BLOCK_M``
rows. A tile reads the keys its queries' band lets them see (causal: up to its last
query's position; a window: from its first query's lower bound). A tile with a long
key range is cut into splits of whole key blocks, enough for about two programs per
multiprocessor, each at least four blocks long; a tile of many queries usually has
enough company to keep one split.

Every program's work is one row of ``items`` (int32, :data:`ITEM_FIELDS` wide): the
tile's sequence, its first packed query, how many queries, the position of the first
(the sequence's last positions, bottom-right aligned), its first query head within the
group, the keys ``[lo, hi)`` of this split, and the partial slot it writes (-1: the
tile's only split, written to the output directly). Tiles of several splits get a row
of ``merges`` (:data:`MERGE_FIELDS` wide): sequence, first query, count, first head,
first partial slot and the number of splits. Items are ordered by keys read, longest
first, so the heaviest programs start first.

Plain NumPy: no Triton import.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["ITEM_FIELDS", "MERGE_FIELDS", "TilePlan", "plan_tiles"]

#: Columns of ``items``: sequence, first packed query, queries, position of the first
#: query, first query head within the group, first key, key stop, partial slot.
ITEM_FIELDS = 8
#: Columns of ``merges``: sequence, first packed query, queries, first query head
#: within the group, first partial slot, splits.
MERGE_FIELDS = 6


class TilePlan(NamedTuple):
    """What the paged kernels are launched with (see the module docstring)."""

    tile_heads: int
    tile_queries: int
    items: np.ndarray
    merges: np.ndarray
    parts: int


def plan_tiles(query_starts: list[int], key_lengths: list[int], group: int, block_m: int,
               block_n: int, band: tuple[int | None, int | None], num_kv_heads: int,
               sm_count: int | None, num_splits: int | None = None) -> TilePlan:
    """The plan of a call whose sequence ``s`` has queries
    ``query_starts[s]:query_starts[s + 1]`` and ``key_lengths[s]`` keys, ``group``
    query heads per K/V head, tiles of ``block_m`` rows reading ``block_n`` keys a
    step, and the mask's ``band`` ``(lower, upper)`` on ``j - position`` (None: open).
    ``sm_count`` is the device's multiprocessors (None: the interpreter);
    ``num_splits`` caps every tile's splits instead of the heuristic."""
    tile_heads = min(group, block_m)
    tile_queries = block_m // tile_heads
    tiles = _query_tiles(np.asarray(query_starts, dtype=np.int64),
                         np.asarray(key_lengths, dtype=np.int64), group, tile_heads,
                         tile_queries, band)
    keys = tiles[6] - tiles[5]
    order = np.argsort(-keys, kind="stable")  # the most keys first
    seq, row, count, position, head, lo, hi = (a[order] for a in tiles)
    splits, per_split = _split_counts(lo, hi, block_n, len(seq) * num_kv_heads, sm_count,
                                      num_splits)
    split_tile = splits > 1
    part_base = np.cumsum(np.where(split_tile, splits, 0)) - np.where(split_tile, splits, 0)
    tile = np.repeat(np.arange(len(seq)), splits)
    split = np.arange(len(tile)) - np.repeat(np.cumsum(splits) - splits, splits)
    start = (lo // block_n)[tile] + split * per_split[tile]
    items = np.stack([
        seq[tile], row[tile], count[tile], position[tile], head[tile],
        np.maximum(lo[tile], start * block_n),
        np.minimum(hi[tile], (start + per_split[tile]) * block_n),
        np.where(split_tile[tile], part_base[tile] + split, -1)], axis=1)
    merges = np.stack([seq, row, count, head, part_base, splits], axis=1)[split_tile]
    return TilePlan(tile_heads, tile_queries, _int32(items, ITEM_FIELDS),
                    _int32(merges, MERGE_FIELDS), int(splits[split_tile].sum()))


def _split_counts(lo: np.ndarray, hi: np.ndarray, block_n: int, programs: int,
                  sm_count: int | None, num_splits: int | None,
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(splits, blocks per split)`` of tiles reading keys ``[lo, hi)``: enough splits
    for about two programs per multiprocessor (``programs`` without splits), each at
    least four key blocks long, or at most ``num_splits``; none left empty."""
    blocks = np.where(hi > lo, -(-hi // block_n) - lo // block_n, 0)
    if num_splits is None:
        # the interpreter: a few splits, so that the merge is exercised
        want = -(-2 * (2 if sm_count is None else sm_count) // max(programs, 1))
        splits = np.minimum(want, blocks // 4)
    else:
        splits = np.minimum(num_splits, blocks)
    splits = np.maximum(splits, 1)
    per_split = -(-np.maximum(blocks, 1) // splits)
    return np.where(blocks > 0, -(-blocks // per_split), 1), per_split


def _query_tiles(starts: np.ndarray, lengths: np.ndarray, group: int, tile_heads: int,
                 tile_queries: int, band: tuple[int | None, int | None],
                 ) -> tuple[np.ndarray, ...]:
    """``(sequence, first row, count, position, first head, lo, hi)`` of every tile,
    sequence by sequence, query chunks outer and head chunks inner."""
    counts = np.diff(starts)
    head_chunks = -(-group // tile_heads)
    per_sequence = -(-counts // tile_queries) * head_chunks
    seq = np.repeat(np.arange(len(counts)), per_sequence)
    k = np.arange(len(seq)) - np.repeat(np.cumsum(per_sequence) - per_sequence, per_sequence)
    first = (k // head_chunks) * tile_queries  # the tile's first query in its sequence
    head = (k % head_chunks) * tile_heads
    count = np.minimum(tile_queries, counts[seq] - first)
    length = lengths[seq]
    position = length - counts[seq] + first
    lower, upper = band
    lo = np.zeros_like(position) if lower is None else np.maximum(position + lower, 0)
    hi = length if upper is None else np.minimum(position + count + upper, length)
    empty = hi <= lo  # a band that hides every key of the tile: nothing read
    lo, hi = np.where(empty, 0, lo), np.where(empty, 0, hi)
    return seq, starts[seq] + first, count, position, head, lo, hi


def _int32(rows: np.ndarray, width: int) -> np.ndarray:
    return np.ascontiguousarray(rows.reshape(-1, width), dtype=np.int32)
