"""Which keys each row of a unit meets, and which of those entries to mask.

A unit's rows are split into sub-tiles of ``Config.mask_step`` rows; under a causal or
sliding-window mask each sub-tile reaches its own key range, so the unit is computed
as blocks of (key range, row range) that follow the mask's staircase instead of its
bounding box.
Key blocks never exceed the problem's ``block_k``. Within a block only the runs of
``Config.mask_chunk`` keys that the mask does not cover get an element-wise mask; dense
masks are read, and blocks they leave empty are dropped.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import slice_tile

from ._memo import Store

if TYPE_CHECKING:
    from ._problem import Problem

__all__ = ["Block", "blocks", "head_view"]

Block = tuple[int, int, int, int, list[Any]]
"""``(k0, k1, r0, r1, tiles)``: keys ``k0:k1`` against the unit's rows ``r0:r1``, with
``tiles`` the masks to apply: ``(key offset, row offset, hidden)`` for positional runs
(``hidden`` keys by queries, True where masked), or a dense tile (queries by keys,
True = attend)."""


#: Blocks of units without a dense mask, which depend on positions only: shared by
#: the heads, batch elements and threads of a call, and by later calls of that shape.
_positional_blocks: Store[list[Block]] = Store("blocks of positional units")


def blocks(p: Problem, b: tuple[int, ...], h: int, q0: int, q1: int, lo: int,
           hi: int) -> list[Block]:
    """The blocks of one unit, in key order; empty ones dropped."""
    if not p.dense:
        key = (p.config, p.positional, p.q_len, p.kv_len, p.block_k, q0, q1, lo, hi)
        return _positional_blocks.get(key, lambda: [
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
    n, step = q1 - q0, p.config.mask_step
    if p.positional is None or n <= step:
        return [(k0, min(hi, k0 + p.block_k), 0, n) for k0 in range(lo, hi, p.block_k)]
    subs = []
    for s0 in range(q0, q1, step):
        s1 = min(q1, s0 + step)
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
    step, chunk = p.config.mask_step, p.config.mask_chunk
    if mask is None or mask.covers(q0, q1, k0, k1, lq, lk):
        return []
    tiles, start = [], None
    for c0 in range(k0, k1, chunk):
        c1 = min(k1, c0 + chunk)
        whole = mask.covers(q0, q1, c0, c1, lq, lk)
        if not whole and start is None:
            start = c0
        if start is not None and (whole or c1 == k1):
            end = c0 if whole else c1
            cut = [s0 for s0 in range(q0, q1, step)
                   if not mask.covers(s0, min(q1, s0 + step), start, end, lq, lk)]
            r0, r1 = cut[0], min(q1, cut[-1] + step)
            allowed = mask.tile(np, r0, r1, start, end, lq, lk)
            hidden = np.empty((end - start, r1 - r0), bool)  # the score tile's layout
            np.logical_not(np.broadcast_to(allowed, (r1 - r0, end - start)).T, out=hidden)
            tiles.append((start - k0, r0 - q0, hidden))
            start = None
    return tiles
