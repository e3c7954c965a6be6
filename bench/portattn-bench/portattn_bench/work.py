"""The work of one attention call, counted in floating-point operations: two GEMMs,
two per multiply-add, over the (query, key) pairs the call visits."""

from __future__ import annotations

__all__ = ["attention_flops", "causal_pairs"]


def causal_pairs(q_len: int, kv_len: int) -> int:
    """(query, key) pairs a bottom-right causal mask allows."""
    offset = kv_len - q_len
    return sum(min(kv_len, max(0, i + offset + 1)) for i in range(q_len))


def attention_flops(q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                    v_shape: tuple[int, ...], causal: bool) -> int:
    """:func:`flops` of attention on arrays of these shapes ``(..., H, L, D)``."""
    *lead, heads, q_len, head_dim = q_shape
    rows = heads
    for n in lead:
        rows *= n
    pairs = causal_pairs(q_len, k_shape[-2]) if causal else q_len * k_shape[-2]
    return 2 * rows * pairs * (head_dim + v_shape[-1])
