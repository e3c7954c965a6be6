"""The tiled kernel: flash-style attention in pure Array API.

Queries are processed in blocks; for each block the keys are visited in blocks with an
online softmax (running max ``m``, running denominator ``l``, rescaled accumulator), so
memory is O(L * block) rather than O(L^2). The mask's block form tells which tiles a
query block visits (causal: about half, packed documents: those inside a document)
and which of them need no mask.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .._lib import attach_for
from ._dropout import seed_word, seed_words
from ._portable import (
    PortableKernel,
    add_sinks,
    attend_values,
    cast,
    dropped,
    empty_result,
    finish,
    finite_or_zero,
    group_kv,
    group_queries,
    is_empty,
    kept,
    scores_of_clean,
    split_nonfinite,
    ungroup,
    with_empty_rows,
)

if TYPE_CHECKING:
    from .._inputs import AttentionInputs
    from ..masks import BlockMask

#: Score-tile budget in elements across all batch and head rows: large tiles amortise
#: per-call overhead, small ones stay in cache.
TILE_ELEMENTS = 1 << 18
MIN_BLOCK_Q = 16
MAX_BLOCK_K = 256


class TiledKernel(PortableKernel):
    """O(L * block) memory flash-style kernel; the default for everything it supports."""

    name = "tiled"
    priority = 10

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        if inputs.dropout_p:  # a seed drawn now, so the backward draws the same mask
            inputs = inputs._replace(dropout_seed=seed_words(inputs))
        attach = attach_for(inputs.namespace) if inputs.requires_grad else None
        # With gradients, the library's wiring saves (q, k, v, out, lse) and runs the
        # flash backward; recording every tile instead would keep O(Lq * Lk).
        out, lse = (tiled_attention(inputs, recorded=inputs.requires_grad) if attach is None
                    else attach(inputs))
        return out, lse if inputs.return_lse else None, None


def block_sizes(inputs: AttentionInputs) -> tuple[int, int]:
    """Query and key block lengths for a call, within :data:`TILE_ELEMENTS`."""
    rows = math.prod(inputs.batch_shape) * inputs.num_heads
    block_k = max(1, min(inputs.kv_len, MAX_BLOCK_K))
    block_q = max(MIN_BLOCK_Q, TILE_ELEMENTS // max(1, rows * block_k))
    return min(block_q, max(1, inputs.q_len)), block_k


def tiled_attention(inputs: AttentionInputs, block_q: int | None = None,
                    block_k: int | None = None, *, recorded: bool = False) -> tuple[Any, Any]:
    """``(out, lse)`` computed tile by tile. ``recorded``: the library's autograd records
    the tiles (no wiring is installed), so the score products take queries and keys
    cleaned of non-finite entries (see :func:`scores_of_clean`)."""
    if is_empty(inputs):
        return empty_result(inputs)
    xp = inputs.xp
    default_q, default_k = block_sizes(inputs)
    block_q, block_k = block_q or default_q, block_k or default_k
    ct = inputs.compute_dtype
    hkv = inputs.num_kv_heads
    query, bad_query = inputs.query, None
    k, bad_k = group_kv(xp, cast(xp, inputs.key, ct)), None
    if recorded:  # split once per call, not per block (each split reads the values)
        query, bad_query = split_nonfinite(xp, query)
        k, bad_k = split_nonfinite(xp, k)
    v, bad = split_nonfinite(xp, group_kv(xp, cast(xp, inputs.value, ct)))
    blocks = inputs.blocks(block_q, block_k)
    word = seed_word(inputs) if inputs.dropout_p else None
    outs, lses, masses = [], [], []
    for a in range(blocks.num_q_blocks):
        q0, q1 = blocks.q_range(a)
        q = group_queries(xp, cast(xp, query[..., q0:q1, :], ct) * inputs.scale, hkv)
        bad_q = None if bad_query is None else group_queries(
            xp, cast(xp, bad_query[..., q0:q1, :], ct), hkv)
        out, lse, has_mass = _query_block(inputs, (q, bad_q), (k, bad_k), v, bad, blocks, a,
                                          word)
        outs.append(out)
        lses.append(lse)
        masses.append(has_mass)
    out = ungroup(xp, _joined(xp, outs, -2))
    lse = with_empty_rows(xp, _joined(xp, lses, -1), _joined(xp, masses, -1))
    return cast(xp, out, inputs.query.dtype), ungroup(xp, lse, trailing=1)


def _joined(xp: Any, parts: list[Any], axis: int) -> Any:
    return xp.concat(parts, axis=axis) if len(parts) > 1 else parts[0]


def _query_block(inputs: AttentionInputs, queries: tuple[Any, Any], keys: tuple[Any, Any],
                 v: Any, bad: Any, blocks: BlockMask, a: int,
                 word: Any) -> tuple[Any, Any, Any]:
    """Query block ``a`` against the key tiles it visits; ``queries`` and ``keys`` are
    ``(values, rows that held a non-finite entry or None)``, ``word`` dropout's seed
    word (None without dropout: the denominator sums the weights before it)."""
    xp = inputs.xp
    (q, bad_q), (k, bad_k) = queries, keys
    q0, q1 = blocks.q_range(a)
    acc = denom = m = m_safe = None
    for b, full in blocks.kv_blocks(a):
        k0, k1 = blocks.kv_range(b)
        tile = scores_of_clean(inputs, q, bad_q, k[..., k0:k1, :],
                               None if bad_k is None else bad_k[..., k0:k1, :], q0, q1, k0,
                               k1, masked=not full)
        m_tile = xp.max(tile.s, axis=-1, keepdims=True)
        m_new = m_tile if m is None else xp.maximum(m, m_tile)
        m_safe = finite_or_zero(xp, m_new)
        p = tile.weights(xp, m_safe)
        pv = attend_values(xp, dropped(inputs, p, kept(inputs, word, q0, q1, k0, k1)),
                           v[..., k0:k1, :], None if bad is None else bad[..., k0:k1, :], tile)
        row_sum = xp.sum(p, axis=-1, keepdims=True)
        if acc is None:
            acc, denom = pv, row_sum
        else:
            alpha = xp.exp(m - m_safe)
            acc = acc * alpha + pv
            denom = denom * alpha + row_sum
        m = m_new
    if acc is None:  # the mask leaves this query block no keys at all
        shape = (*q.shape[:-1], v.shape[-1])
        acc = xp.zeros(shape, dtype=q.dtype, device=inputs.device_obj)
        m_safe = denom = xp.zeros((*shape[:-1], 1), dtype=q.dtype, device=inputs.device_obj)
    return finish(xp, *add_sinks(inputs, acc, m_safe, denom))
