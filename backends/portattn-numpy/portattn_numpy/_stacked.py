"""The loop of stacked heads: small heads, many at a time.

When each head's whole problem is small (its scores fill a small share of a tile), the
Python around each NumPy call costs more than its arithmetic, and tiles per head would
be mostly overhead. A unit is then a run of heads of one batch element
(``_strategy.Stacked``), computed whole: all their scores in one stacked product,
masked by the mask's own tile, then the values in a second stacked product.
Grouped-query heads are stacked under their shared key/value head (``(kv heads, group,
...)``), so keys and values are read in place. A score change (``_changes``) is added
like a bias, from a view of what the call made of it once. Only the fast way is tried
here; a unit it cannot trust is redone in tiles, the careful way (``_run``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._scores import scores, trustworthy
from ._scratch import take

if TYPE_CHECKING:
    from ._units import Plan, Unit

__all__ = ["Scratch", "attend"]


class Scratch:
    """Nothing kept from unit to unit: each takes its arrays, shaped for its heads
    (``_scratch.take``)."""

    def __init__(self, plan: Plan) -> None:
        pass


def _heads(a: Any, b: tuple[int, ...], h0: int, kv: int, group: int) -> Any:
    """Heads ``h0 : h0 + kv*group`` of a full-rank broadcastable array, as
    ``(kv|1, group|1, rows, cols)``."""
    lead = tuple(0 if size == 1 else i for i, size in zip(b, a.shape[:-3], strict=True))
    if a.shape[-3] == 1:
        return a[(*lead, slice(0, 1))][None]
    return a[(*lead, slice(h0, h0 + kv * group))].reshape(kv, group, *a.shape[-2:])


def attend(plan: Plan, _scratch: Scratch, unit: Unit) -> bool:
    """The unit's heads of its batch element, whole, the fast way; False when they must
    be redone carefully."""
    p, st, on_tile = plan.problem, plan.strategy, plan.config.on_tile
    b, h0 = unit.batch, unit.head
    kv0 = h0 // p.group
    kv = min(st.kv_heads, p.key.shape[-3] - kv0)
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
    if p.change is not None:
        tile += p.change.stacked(b, h0, kv, p.group)
    plan.loops.exponential(tile)
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

