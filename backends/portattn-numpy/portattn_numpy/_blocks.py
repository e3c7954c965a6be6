"""Which keys each row of a unit meets, and which of those entries to mask.

A unit's rows are split into sub-tiles of :data:`SUB_Q`; under a causal or sliding-window
mask each sub-tile reaches its own key range, so the unit is computed as blocks of
(key range, row range) that follow the mask's staircase instead of its bounding box.
Key blocks never exceed the problem's ``block_k``. Within a block only the runs of
:data:`MASK_CHUNK` keys that the mask does not cover get an element-wise mask; dense
masks are read, and blocks they leave empty are dropped.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from portattn.masks import slice_tile

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._problem import Problem

__all__ = ["Block", "blocks", "head_view", "remembered"]

T = TypeVar("T")

#: Query rows per step of the staircase a positional mask is followed by.
SUB_Q = 128
#: Keys per step when looking for the parts of a block a mask leaves whole.
MASK_CHUNK = 64

Block = tuple[int, int, int, int, list[Any]]
"""``(k0, k1, r0, r1, tiles)``: keys ``k0:k1`` against the unit's rows ``r0:r1``, with
``tiles`` the masks to apply: ``(key offset, row offset, hidden)`` for positional runs
(``hidden`` keys by queries, True where masked), or a dense tile (queries by keys,
True = attend)."""


MAX_REMEMBERED = 4096
_MISSING = object()


def remembered(store: dict[tuple, T], key: tuple, make: Callable[[], T]) -> T:
    """``store[key]``, made by ``make()`` the first time. Past :data:`MAX_REMEMBERED`
    entries (shapes that change every call) the store starts over."""
    found = store.get(key, _MISSING)
    if found is _MISSING:
        found = make()
        if len(store) >= MAX_REMEMBERED:
            store.clear()
        store[key] = found  # a duplicate from another thread is harmless
    return found


#: Blocks of units without a dense mask, which depend on positions only: shared by
#: the heads, batch elements and threads of a call, and by later calls of that shape.
_positional_blocks: dict[tuple, list[Block]] = {}


def blocks(p: Problem, b: tuple[int, ...], h: int, q0: int, q1: int, lo: int,
           hi: int) -> list[Block]:
    """The blocks of one unit, in key order; empty ones dropped."""
    if not p.dense:
        key = (p.positional, p.q_len, p.kv_len, p.block_k, q0, q1, lo, hi)
        return remembered(_positional_blocks, key, lambda: [
            (k0, k1, r0, r1, _positional_tiles(p, q0 + r0, q0 + r1, k0, k1))
            for k0, k1, r0, r1 in _spans(p, q0, q1, lo, hi)])
    dense = [head_view(m, b, h) for m in p.dense]
    found = []
    for k0, k1, r0, r1 in _spans(p, q0, q1, lo, hi):
        tiles = []
        for allowed in dense:
            tile = slice_tile(allowed, q0 + r0, q0 + r1, k0, k1)
            if not tile.any():
                break
            if not tile.all():
                tiles.append(tile)
        else:
            tiles += _positional_tiles(p, q0 + r0, q0 + r1, k0, k1)
            found.append((k0, k1, r0, r1, tiles))
    return found


def head_view(full: Any, b: tuple[int, ...], h: int) -> Any:
    """The ``(Lq|1, Lk|1)`` slice of a full-rank broadcastable array for one head."""
    lead = tuple(0 if size == 1 else i for i, size in zip(b, full.shape[:-3], strict=True))
    return full[(*lead, 0 if full.shape[-3] == 1 else h)]


def _spans(p: Problem, q0: int, q1: int, lo: int,
           hi: int) -> list[tuple[int, int, int, int]]:
    """``(k0, k1, r0, r1)`` covering every allowed pair of the unit."""
    n = q1 - q0
    if p.positional is None or n <= SUB_Q:
        return [(k0, min(hi, k0 + p.block_k), 0, n) for k0 in range(lo, hi, p.block_k)]
    subs = []
    for s0 in range(q0, q1, SUB_Q):
        s1 = min(q1, s0 + SUB_Q)
        a, z = p.positional.key_range(s0, s1, p.q_len, p.kv_len)
        if max(a, lo) < min(z, hi):
            subs.append((s0 - q0, s1 - q0, max(a, lo), min(z, hi)))
    cuts = sorted({lo, hi, *range(lo, hi, p.block_k), *(c for s in subs for c in s[2:])})
    spans: list[tuple[int, int, int, int]] = []
    for a, z in itertools.pairwise(cuts):
        rows = [s for s in subs if s[2] < z and s[3] > a]
        if not rows:
            continue
        r0, r1 = rows[0][0], rows[-1][1]
        last = spans[-1] if spans else None
        if last and last[1] == a and last[2:] == (r0, r1) and z - last[0] <= p.block_k:
            spans[-1] = (last[0], z, r0, r1)  # same rows: one wider block
        else:
            spans.append((a, z, r0, r1))
    return spans


def _positional_tiles(p: Problem, q0: int, q1: int, k0: int, k1: int) -> list[Any]:
    """``(key offset, row offset, hidden)`` for each run of keys the positional mask
    cuts, narrowed to the sub-tiles of rows it cuts there."""
    mask, lq, lk = p.positional, p.q_len, p.kv_len
    if mask is None or mask.covers(q0, q1, k0, k1, lq, lk):
        return []
    tiles, start = [], None
    for c0 in range(k0, k1, MASK_CHUNK):
        c1 = min(k1, c0 + MASK_CHUNK)
        whole = mask.covers(q0, q1, c0, c1, lq, lk)
        if not whole and start is None:
            start = c0
        if start is not None and (whole or c1 == k1):
            end = c0 if whole else c1
            cut = [s0 for s0 in range(q0, q1, SUB_Q)
                   if not mask.covers(s0, min(q1, s0 + SUB_Q), start, end, lq, lk)]
            r0, r1 = cut[0], min(q1, cut[-1] + SUB_Q)
            allowed = mask.tile(np, r0, r1, start, end, lq, lk)
            hidden = np.empty((end - start, r1 - r0), bool)  # the score tile's layout
            np.logical_not(np.broadcast_to(allowed, (r1 - r0, end - start)).T, out=hidden)
            tiles.append((start - k0, r0 - q0, hidden))
            start = None
    return tiles
