"""The largest score of each query row, after every change to the scores (scale,
softcap, bias, ALiBi, a score change), over the keys the mask lets it see: what
``return_max_scores`` returns, for training-stability checks such as QK-clip.

One pass over the tiles the mask visits, whatever kernel ran the call: the scores'
products again, no exponentials and no values. It reads the inputs without their
gradients (no library records it), so the row maxima are constants.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .._lib import without_grad
from ._portable import cast, group_kv, group_queries, is_empty, lowest, scores, ungroup
from ._tiled import block_sizes

if TYPE_CHECKING:
    from .._inputs import AttentionInputs

__all__ = ["max_scores"]


def max_scores(inputs: AttentionInputs) -> Any:
    """``(..., Hq, Lq)`` in the compute dtype: each row's largest visible score, and
    ``-inf`` for a row that sees no key (as its log-sum-exp)."""
    xp = inputs.xp
    inputs = _constants(inputs)
    lead = (*inputs.batch_shape, inputs.num_heads, inputs.q_len)
    ct = inputs.compute_dtype
    if is_empty(inputs):
        return xp.full(lead, -math.inf, dtype=ct, device=inputs.device_obj)
    hkv = inputs.num_kv_heads
    k = group_kv(xp, cast(xp, inputs.key, ct))
    blocks = inputs.blocks(*block_sizes(inputs))
    rows = []
    for a in range(blocks.num_q_blocks):
        q0, q1 = blocks.q_range(a)
        q = group_queries(xp, cast(xp, inputs.query[..., q0:q1, :], ct) * inputs.scale, hkv)
        top = seen = None
        for b, full in blocks.kv_blocks(a):
            k0, k1 = blocks.kv_range(b)
            tile = scores(inputs, q, k[..., k0:k1, :], q0, q1, k0, k1, masked=not full)
            visible = tile.visible(xp)
            part = xp.max(xp.where(visible, tile.s, lowest(xp, tile.s.dtype)), axis=-1)
            any_seen = xp.any(visible, axis=-1)
            top = part if top is None else xp.maximum(top, part)
            seen = any_seen if seen is None else seen | any_seen
        if top is None:  # the mask leaves this query block no keys
            rows.append(xp.full((*q.shape[:-1],), -math.inf, dtype=ct,
                                device=inputs.device_obj))
        else:
            rows.append(xp.where(seen, top, -math.inf))
    joined = xp.concat(rows, axis=-1) if len(rows) > 1 else rows[0]
    return ungroup(xp, joined, trailing=1)


def _constants(inputs: AttentionInputs) -> AttentionInputs:
    """``inputs`` with every array read without its gradient."""
    change = inputs.score_mod
    return inputs._replace(
        query=without_grad(inputs.query), key=without_grad(inputs.key),
        bias=None if inputs.bias is None else without_grad(inputs.bias),
        score_mod=None if change is None else change.with_arrays(
            tuple(without_grad(a) for a in change.arrays)))
