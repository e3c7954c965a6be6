"""Small heads, many at a time.

When each head's whole problem is small (its scores fill a small share of a tile), the
Python around each NumPy call costs more than its arithmetic, and tiles per head would
be mostly overhead. A unit is then a run of heads of one batch element,
computed whole: all their scores in one stacked product, masked by the mask's own
tile, then the values in a second stacked product. Grouped-query heads are stacked
under their shared key/value head (``(kv heads, group, ...)``), so keys and values are
read in place. Only the fast way is tried here; ``_strategy.work`` redoes a unit it
cannot trust in tiles, the careful way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import FULL, HIDDEN

from ._scores import scores, trustworthy
from ._scratch import take
from ._units import Unit, work

if TYPE_CHECKING:
    from ._config import Config
    from ._loops import Loops
    from ._memo import CallPlans
    from ._problem import Problem

__all__ = ["SHARE", "Stacked", "heads_per_unit", "plan"]

#: A head is stacked when its scores fill at most ``1 / SHARE[tiles_compiled,
#: tiles_skip]`` of a tile: less where tiles skip work the mask's block form hides
#: (causal, sliding window, lengths, documents; stacking computes every pair), and less
#: where tiles run their unmasked blocks in one compiled call a unit
#: (``_compiled_blocks``; a mask with no full tile, random dense ones, leaves them none):
#: the shares where tiles and stacking measured about as fast.
SHARE = {(False, False): 4, (False, True): 16, (True, False): 16, (True, True): 32}


def heads_per_unit(q_len: int, kv_len: int, group: int, kv_heads: int, tile_elements: int,
                   *, tiles_skip: bool = False, tiles_compiled: bool = False) -> int:
    """Key/value heads per stacked unit (their query heads come along), or 0 when the
    heads are too large to stack."""
    per_head = q_len * kv_len
    share = SHARE[tiles_compiled, tiles_skip]
    if per_head == 0 or per_head * share > tile_elements:
        return 0
    return max(1, min(kv_heads, tile_elements // (per_head * group)))


@dataclass(frozen=True)
class Stacked:
    """The ``stacked`` strategy: ``kv_heads`` key/value heads (and their query heads)
    to a unit, whole."""

    kv_heads: int
    keep: Any
    """The whole mask as 0/1 in the scores' dtype and layout (full rank, ``(..., Lk,
    Lq)``: keys by queries), or None."""
    has_keys: Any
    """Which query rows the mask lets see any key (full rank, ``(..., Lq, 1)``), or
    None."""
    config: Config
    loops: Loops
    name = "stacked"

    def units(self, p: Problem, b: tuple[int, ...]) -> list[Unit]:
        step = self.kv_heads * p.group
        return [Unit(b, h, 0, p.q_len, 0, p.kv_len)
                for h in range(0, p.query.shape[-3], step)]

    def heads(self, p: Problem, h: int) -> range:
        return range(h, min(p.query.shape[-3], h + self.kv_heads * p.group))

    def prepare(self, p: Problem, units: list[Unit]) -> None:
        pass  # nothing a unit plans costs more than a lookup after the first call

    def scratch(self, p: Problem) -> None:
        return None  # each unit takes its arrays, shaped for its heads (``_scratch.take``)

    def attend(self, p: Problem, _scratch: None, unit: Unit) -> bool:
        return _attend(p, self, *unit)


def plan(p: Problem, config: Config, loops: Loops, plans: CallPlans,
         threads: int) -> Stacked | None:
    """The strategy for ``p`` when its heads are small enough to stack, else None."""
    hq = p.query.shape[-3]
    if not hq:  # no query heads at all: nothing to stack, and the group size is 0
        return None
    # tiles skip the tiles the mask hides, and run its full ones compiled where they can
    states = None if p.blocks is None else p.blocks.states
    skips = states is not None and bool((states == HIDDEN).any())
    compiled = loops.compiled is not None and (states is None or bool((states == FULL).any()))
    kv = heads_per_unit(p.q_len, p.kv_len, p.group, hq // p.group, p.tile_elements,
                        tiles_skip=skips, tiles_compiled=compiled)
    if not kv:
        return None
    # fewer heads to a unit where that gives work to threads that would idle
    batch = math.prod(p.query.shape[:-3])
    width = p.query.shape[-1] + p.value.shape[-1]
    busy = min(threads, work(batch * hq, p.q_len, p.kv_len, width)
               // config.min_scores_per_thread)
    units_per_element = math.ceil(busy / max(batch, 1))
    if units_per_element > 1:
        kv = min(kv, math.ceil(hq // p.group / units_per_element))
    allowed = _whole_mask(p)
    if allowed is None:
        return Stacked(kv, None, None, config, loops)
    # once per call: multiplying by a contiguous 0/1 tile is several times faster than
    # by the transposed boolean mask
    keep = np.ascontiguousarray(allowed.swapaxes(-1, -2), dtype=p.query.dtype)
    return Stacked(kv, keep, allowed.any(axis=-1, keepdims=True), config, loops)


def _whole_mask(p: Problem) -> Any:
    """The mask over the whole problem, full rank (``(*batch|1, H|1, Lq|1, Lk|1)``)."""
    if p.mask is None:
        return None
    lq, lk = p.q_len, p.kv_len
    allowed = p.mask.tile(np, 0, lq, 0, lk, lq, lk)
    if allowed is None:  # every part covers everything
        return None
    allowed = np.asarray(allowed)
    rank = p.query.ndim
    return allowed.reshape((1,) * (rank - allowed.ndim) + allowed.shape)


def _heads(a: Any, b: tuple[int, ...], h0: int, kv: int, group: int) -> Any:
    """Heads ``h0 : h0 + kv*group`` of a full-rank broadcastable array, as
    ``(kv|1, group|1, rows, cols)``."""
    lead = tuple(0 if size == 1 else i for i, size in zip(b, a.shape[:-3], strict=True))
    if a.shape[-3] == 1:
        return a[(*lead, slice(0, 1))][None]
    return a[(*lead, slice(h0, h0 + kv * group))].reshape(kv, group, *a.shape[-2:])


def _attend(p: Problem, st: Stacked, b: tuple[int, ...], h0: int, q0: int, q1: int,
            lo: int, hi: int) -> bool:
    """Heads ``h0 : h0 + st.kv_heads * p.group`` of batch element ``b``, whole, the fast
    way; False when they must be redone carefully."""
    kv0 = h0 // p.group
    kv = min(st.kv_heads, p.key.shape[-3] - kv0)
    on_tile = st.config.on_tile
    if on_tile is not None:
        for h in range(h0, h0 + kv * p.group):
            on_tile(b, h, 0, p.q_len, 0, p.kv_len)
    queries = _heads(p.query, b, h0, kv, p.group)  # (kv, group, Lq, D)
    q = np.multiply(queries, p.factor, out=take("unit.q", queries.shape, queries.dtype))
    k = p.key[(*b, slice(kv0, kv0 + kv))][:, None]     # (kv, 1, Lk, D)
    v = p.value[(*b, slice(kv0, kv0 + kv))][:, None]
    lead = q.shape[:2]  # (kv, group, Lk, Lq): keys by queries
    tile = scores(p, k, q.swapaxes(-1, -2), take("unit.scores", (*lead, p.kv_len, p.q_len),
                                                  q.dtype))
    if p.bias is not None:
        tile += _heads(p.bias, b, h0, kv, p.group).swapaxes(-1, -2)
    st.loops.exponential(tile)
    if st.keep is not None:
        tile *= _heads(st.keep, b, h0, kv, p.group)
    sums = np.add.reduce(tile, axis=-2)  # (kv, group, Lq)
    acc = np.matmul(tile.swapaxes(-1, -2), v,  # (kv, group, Lq, Dv)
                    out=take("unit.acc", (*lead, p.q_len, v.shape[-1]), q.dtype))
    # a where= array, even all True, takes NumPy's masked loop: True when no row is empty
    with_keys = True if st.has_keys is None else _heads(st.has_keys, b, h0, kv, p.group)
    has_keys = True if st.has_keys is None else np.broadcast_to(with_keys[..., 0], sums.shape)
    if not trustworthy(sums, acc, p.kv_len, where=has_keys):
        return False
    heads = slice(h0, h0 + kv * p.group)
    out = p.out[(*b, heads)].reshape(acc.shape)
    np.divide(acc, sums[..., None], out=out, where=with_keys)
    if p.lse is not None:
        np.log(sums, out=p.lse[(*b, heads)].reshape(sums.shape), where=has_keys)
    return True

