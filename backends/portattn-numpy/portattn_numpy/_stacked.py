"""Small heads, many at a time.

When each head's whole problem is small (its scores fill a small share of a tile), the
Python around each NumPy call costs more than its arithmetic, and tiles per head would
be mostly overhead. A unit is then a run of heads of one batch element,
computed whole: all their scores in one stacked product, masked by the mask's own
tile, then the values in a second stacked product. Grouped-query heads are stacked
under their shared key/value head (``(kv heads, group, ...)``), so keys and values are
read in place. Only the fast way is tried here; ``_engine`` redoes a unit it cannot
trust in tiles, the careful way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import _scores
from ._scores import scores, trustworthy

if TYPE_CHECKING:
    from ._problem import Problem

__all__ = ["SHARE", "SHARE_WHEN_TILES_SKIP", "attend", "heads_per_unit"]

#: A head is stacked when its scores fill at most ``1/SHARE`` of a tile...
SHARE = 4
#: ...or ``1/SHARE_WHEN_TILES_SKIP`` under a mask whose structure lets tiles skip work
#: (causal, sliding window, lengths): stacking computes every pair.
SHARE_WHEN_TILES_SKIP = 16


def heads_per_unit(q_len: int, kv_len: int, group: int, kv_heads: int, tile_elements: int,
                   *, tiles_skip: bool = False) -> int:
    """Key/value heads per stacked unit (their query heads come along), or 0 when the
    heads are too large to stack."""
    per_head = q_len * kv_len
    share = SHARE_WHEN_TILES_SKIP if tiles_skip else SHARE
    if per_head == 0 or per_head * share > tile_elements:
        return 0
    return max(1, min(kv_heads, tile_elements // (per_head * group)))


def _heads(a: Any, b: tuple[int, ...], h0: int, kv: int, group: int) -> Any:
    """Heads ``h0 : h0 + kv*group`` of a full-rank broadcastable array, as
    ``(kv|1, group|1, rows, cols)``."""
    lead = tuple(0 if size == 1 else i for i, size in zip(b, a.shape[:-3], strict=True))
    if a.shape[-3] == 1:
        return a[(*lead, slice(0, 1))][None]
    return a[(*lead, slice(h0, h0 + kv * group))].reshape(kv, group, *a.shape[-2:])


def attend(p: Problem, b: tuple[int, ...], h0: int, q0: int, q1: int, lo: int,
           hi: int) -> bool:
    """Heads ``h0 : h0 + p.stack * p.group`` of batch element ``b``, whole, the fast way;
    False when they must be redone carefully."""
    kv0 = h0 // p.group
    kv = min(p.stack, p.key.shape[-3] - kv0)
    if _scores.on_tile is not None:
        for h in range(h0, h0 + kv * p.group):
            _scores.on_tile(b, h, 0, p.q_len, 0, p.kv_len)
    q = _heads(p.query, b, h0, kv, p.group) * p.factor  # (kv, group, Lq, D), a copy
    k = p.key[(*b, slice(kv0, kv0 + kv))][:, None]     # (kv, 1, Lk, D)
    v = p.value[(*b, slice(kv0, kv0 + kv))][:, None]
    tile = scores(p, k, q.swapaxes(-1, -2))  # (kv, group, Lk, Lq): keys by queries
    if p.bias is not None:
        tile += _heads(p.bias, b, h0, kv, p.group).swapaxes(-1, -2)
    (np.exp2 if p.base2 else np.exp)(tile, out=tile)
    allowed = None if p.allowed is None else _heads(p.allowed, b, h0, kv, p.group)
    if allowed is not None:
        tile *= allowed.swapaxes(-1, -2)
    sums = np.add.reduce(tile, axis=-2)  # (kv, group, Lq)
    acc = np.matmul(tile.swapaxes(-1, -2), v)  # (kv, group, Lq, Dv)
    has_keys = True if allowed is None else np.broadcast_to(allowed.any(axis=-1), sums.shape)
    if not trustworthy(sums, acc, p.kv_len, where=has_keys):
        return False
    heads = slice(h0, h0 + kv * p.group)
    out = p.out[(*b, heads)].reshape(acc.shape)
    np.divide(acc, sums[..., None], out=out, where=np.expand_dims(has_keys, -1))
    if p.lse is not None:
        np.log(sums, out=p.lse[(*b, heads)].reshape(sums.shape), where=has_keys)
    return True

