"""Which tiles a program walks, and the lengths that bound them, shared by the kernels.

A program that owns one block of queries (the forward's pointer and tensor-descriptor
kernels, the backward's dQ pass) finds its batch element's key and query lengths
(:func:`valid_lengths`), and its table row or, for masks the formulas cover, the
band's masked head, mask-free middle and masked tail (:func:`key_walk`,
:func:`key_tiles`). A program that owns one block of keys (the dK/dV pass) walks the
transpose (:func:`query_tiles`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_masks import table_row

__all__ = ["key_tiles", "key_walk", "query_tiles", "valid_lengths"]


@triton.jit
def key_walk(Table, KeyLengths, QueryLengths, off_z, off_h, pid_m, m0, q_len, kv_len,
             table_z, table_h, table_m, lower_off, upper_off, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
             HAS_KEY_LENGTHS: tl.constexpr, HAS_QUERY_LENGTHS: tl.constexpr,
             HAS_TABLE: tl.constexpr):
    """``(kv_valid, q_valid, row, t_lo, u_lo, u_hi, t_hi)`` of query block ``pid_m``
    (rows from ``m0``): the lengths (:func:`valid_lengths`), and the table row with
    ``HAS_TABLE``, else the band's key bounds (:func:`key_tiles`; ``row`` is then
    ``Table``, unread); what ``tile_span`` reads."""
    kv_valid, q_valid = valid_lengths(KeyLengths, QueryLengths, off_z, q_len, kv_len,
                                      HAS_KEY_LENGTHS, HAS_QUERY_LENGTHS)
    t_lo = 0
    u_lo = 0
    u_hi = 0
    t_hi = 0
    if HAS_TABLE:
        row = table_row(Table, off_z, off_h, pid_m, table_z, table_h, table_m)
    else:
        row = Table
        t_lo, u_lo, u_hi, t_hi = key_tiles(m0, q_valid, kv_valid, lower_off, upper_off,
                                           BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER)
    return kv_valid, q_valid, row, t_lo, u_lo, u_hi, t_hi


@triton.jit
def valid_lengths(KeyLengths, QueryLengths, off_z, q_len, kv_len,
                  HAS_KEY_LENGTHS: tl.constexpr, HAS_QUERY_LENGTHS: tl.constexpr):
    """``(kv_valid, q_valid)``: batch element ``off_z``'s key and query lengths."""
    kv_valid = kv_len
    if HAS_KEY_LENGTHS:
        kv_valid = tl.minimum(tl.load(KeyLengths + off_z).to(tl.int32), kv_len)
    q_valid = q_len
    if HAS_QUERY_LENGTHS:
        q_valid = tl.minimum(tl.load(QueryLengths + off_z).to(tl.int32), q_len)
    return kv_valid, q_valid


@triton.jit
def key_tiles(m0, q_valid, kv_valid, lower_off, upper_off, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr):
    """Key bounds ``(t_lo, u_lo, u_hi, t_hi)`` of the query block at ``m0`` under a
    band and lengths alone: masked head ``[t_lo, u_lo)``, mask-free middle
    ``[u_lo, u_hi)``, masked tail ``[u_hi, t_hi)``; multiples of ``BLOCK_N``. Forward
    and dQ pass walk the same."""
    # Key range any row of the block may reach, and the range every row reaches.
    m_last = tl.minimum(m0 + BLOCK_M, q_valid) - 1
    k_lo = 0
    k_hi = kv_valid
    full_lo = 0
    full_hi = kv_valid
    if HAS_LOWER:
        k_lo = tl.maximum(m0 + lower_off, 0)
        full_lo = tl.maximum(m_last + lower_off, 0)
    if HAS_UPPER:
        k_hi = tl.minimum(k_hi, m_last + upper_off + 1)
        full_hi = tl.minimum(full_hi, m0 + upper_off + 1)
    k_hi = tl.maximum(k_hi, k_lo)
    k_hi = tl.where(m_last < m0, k_lo, k_hi)  # the whole block is query padding
    t_lo = (k_lo // BLOCK_N) * BLOCK_N
    t_hi = tl.cdiv(k_hi, BLOCK_N) * BLOCK_N
    u_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, t_lo), t_hi)
    u_hi = tl.minimum(tl.maximum((full_hi // BLOCK_N) * BLOCK_N, u_lo), t_hi)
    return t_lo, u_lo, u_hi, t_hi


@triton.jit
def query_tiles(n0, q_valid, kv_valid, lower_off, upper_off, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr):
    """Query bounds ``(t_lo, u_lo, u_hi, t_hi)`` of the key block at ``n0`` under a
    band and lengths alone (the transpose of ``key_tiles``): masked head, mask-free
    middle, masked tail; multiples of ``BLOCK_M``."""
    # Queries that see any key of the block, and those that see every key of it.
    n_last = tl.minimum(n0 + BLOCK_N, kv_valid) - 1
    i_lo = 0
    i_hi = q_valid
    full_lo = 0
    full_hi = q_valid
    if HAS_UPPER:
        i_lo = tl.maximum(n0 - upper_off, 0)
        full_lo = tl.maximum(n0 + BLOCK_N - 1 - upper_off, 0)
    if HAS_LOWER:
        i_hi = tl.minimum(i_hi, n_last - lower_off + 1)
        full_hi = tl.minimum(full_hi, n0 - lower_off + 1)
    i_hi = tl.maximum(i_hi, i_lo)
    i_hi = tl.where(n_last < n0, i_lo, i_hi)  # the whole block is key padding
    t_lo = (i_lo // BLOCK_M) * BLOCK_M
    t_hi = tl.cdiv(i_hi, BLOCK_M) * BLOCK_M
    u_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, t_lo), t_hi)
    u_hi = tl.minimum(tl.maximum((full_hi // BLOCK_M) * BLOCK_M, u_lo), t_hi)
    u_hi = tl.where(n0 + BLOCK_N <= kv_valid, u_hi, u_lo)  # keys past the end: all masked
    return t_lo, u_lo, u_hi, t_hi
