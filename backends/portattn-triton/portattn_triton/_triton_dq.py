"""The dQ pass of the flash-attention backward, written in Triton.

One program per block of ``BLOCK_M`` queries of one (batch, head) pair, walking the key
blocks the forward walks (its table row's full tiles with no mask, then the partial
ones; without a table, the band's masked edges and mask-free middle). Each program owns
its rows of dQ, so no atomics are needed and the result is deterministic; with
``BIAS_GRAD`` it also writes its rows of the bias gradient, ``dS`` of every tile it
visits, and with ``DISTANCE_GRAD`` the diagonal sums of those ``dS`` into its slices of a
score change's gradient buffer (``_triton_distance``). See ``_triton_backward``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_backward import _load_tile, _row_stats, scores_of_tile
from ._triton_distance import (
    distance_row,
    distance_rows,
    distance_slot,
    store_diagonal_sums,
)
from ._triton_dropout import kept, row_key
from ._triton_masks import bias_tile, tile_slot, tile_span, tile_start
from ._triton_walk import key_walk

__all__ = ["dq_kernel"]


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, K, V, Bad, Bits, Bias, DBias, Distance, DDistance, tiles,
              lo, hi, num_cols, offs_m, offs_d, offs_dv, stride_kn, stride_kd, stride_vn,
              stride_vd, stride_bm, stride_bn, q_len, kv_len, kv_valid, head_dim,
              value_head_dim, sm_scale, softcap, lower_off, upper_off, drop_key, drop_threshold,
              drop_scale, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              EVEN_D: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
              HAS_BAD: tl.constexpr, HAS_BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_DISTANCE: tl.constexpr, HAS_TABLE: tl.constexpr, BIAS_GRAD: tl.constexpr,
              DISTANCE_GRAD: tl.constexpr, SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr,
              DROPOUT: tl.constexpr):
    """Add the key blocks of ``range(lo, hi, BLOCK_N)`` (see ``tile_span``) to this
    query block's dQ (with ``DROPOUT``: ``dS = P (dP Z - Delta)``)."""
    offs_n = tl.arange(0, BLOCK_N)
    for pos in range(lo, hi, BLOCK_N):
        start_n = tile_start(tiles, pos, BLOCK_N, HAS_TABLE)
        cols = start_n + offs_n
        kT = _load_tile(K + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                        cols[None, :], kv_len, offs_d[:, None], head_dim, MASKED, EVEN_D)
        vT = _load_tile(V + cols[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
                        cols[None, :], kv_len, offs_dv[:, None], value_head_dim, MASKED,
                        EVEN_D)
        slot = 0
        bias = 0.0
        bad = 0.0
        if MASKED and HAS_BITS:
            slot = tile_slot(tiles, num_cols, pos, BLOCK_N)
        if HAS_BIAS:
            bias = bias_tile(Bias, offs_m[:, None], cols[None, :], q_len, kv_len, stride_bm,
                             stride_bn)
        if HAS_BAD:
            bad = tl.load(Bad + cols, mask=cols < kv_len, other=0.0)[None, :]
        s, t = scores_of_tile(tl.dot(q, kT, input_precision=INPUT_PRECISION), bias, Distance,
                              bad, offs_m[:, None], cols[None, :], kv_valid, lower_off,
                              upper_off, Bits, slot, sm_scale, softcap, MASKED, HAS_LOWER,
                              HAS_UPPER, HAS_BITS, HAS_BIAS, HAS_DISTANCE, HAS_BAD, SOFTCAP,
                              BLOCK_M, BLOCK_N, False)
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, vT, input_precision=INPUT_PRECISION)
        if DROPOUT:
            dp = tl.where(kept(drop_key, offs_m[:, None], cols[None, :], drop_threshold),
                          dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if BIAS_GRAD:  # d(out, lse) / d bias is dS, before the softcap's factor
            tl.store(DBias + offs_m[:, None] * kv_len + cols[None, :], ds,
                     mask=(offs_m[:, None] < q_len) & (cols[None, :] < kv_len))
        if DISTANCE_GRAD:  # dS too, summed along the tile's diagonals
            store_diagonal_sums(distance_slot(DDistance, start_n, kv_len, BLOCK_M, BLOCK_N),
                                ds, start_n, BLOCK_M, BLOCK_N)
        if SOFTCAP:  # d(c tanh(x / c)) / dx = 1 - tanh^2
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def dq_kernel(
        Q, K, V, DO, Lse, Delta, DQ, KeyLengths, QueryLengths, Bad, Table, Bits, Bias, DBias,
        Distance, DDistance, stride_qz, stride_qh, stride_qm, stride_qd,
        stride_kz, stride_kh, stride_kn, stride_kd,
        stride_vz, stride_vh, stride_vn, stride_vd,
        stride_doz, stride_doh, stride_dom, stride_dod,
        stride_dqz, stride_dqh, stride_dqm, stride_dqd,
        stride_bz, stride_bh, stride_bm, stride_bn,
        table_z, table_h, table_m, num_cols,
        num_heads, group_size, q_len, kv_len, head_dim, value_head_dim,
        sm_scale, softcap, lower_off, upper_off, Word, drop_threshold, drop_scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_LOWER: tl.constexpr,
        HAS_UPPER: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
        HAS_QUERY_LENGTHS: tl.constexpr, HAS_BAD: tl.constexpr, HAS_BITS: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_DISTANCE: tl.constexpr, HAS_TABLE: tl.constexpr,
        BIAS_GRAD: tl.constexpr, DISTANCE_GRAD: tl.constexpr, SOFTCAP: tl.constexpr,
        REVERSE: tl.constexpr, INPUT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    """Grid ``(Z * num_heads, cdiv(q_len, BLOCK_M))``; writes ``DQ`` (and, with
    ``BIAS_GRAD``, the visited tiles of ``DBias``, ``(Z, num_heads, q_len, kv_len)``
    float32; with ``DISTANCE_GRAD``, the program's slices of ``DDistance``, see
    ``_distance.gradient_buffer``). ``Distance`` is a score change by distance, as the
    forward reads it."""
    pid_zh = tl.program_id(0)
    pid_m = tl.program_id(1)
    if REVERSE:  # causal-like bands: the last query blocks do the most work, start them first
        pid_m = tl.num_programs(1) - 1 - pid_m
    off_z = (pid_zh // num_heads).to(tl.int64)
    off_h = (pid_zh % num_heads).to(tl.int64)
    off_kvh = off_h // group_size  # grouped-query: K/V head shared by the group
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kv_valid, _, row, t_lo, u_lo, u_hi, t_hi = key_walk(
        Table, KeyLengths, QueryLengths, off_z, off_h, pid_m, m0, q_len, kv_len, table_z,
        table_h, table_m, lower_off, upper_off, BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER,
        HAS_KEY_LENGTHS, HAS_QUERY_LENGTHS, HAS_TABLE)

    in_q = offs_m < q_len
    q = _load_tile(Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm
                   + offs_d[None, :] * stride_qd, offs_m[:, None], q_len, offs_d[None, :],
                   head_dim, True, EVEN_D)
    do = _load_tile(DO + off_z * stride_doz + off_h * stride_doh + offs_m[:, None] * stride_dom
                    + offs_dv[None, :] * stride_dod, offs_m[:, None], q_len,
                    offs_dv[None, :], value_head_dim, True, EVEN_D)
    row0 = pid_zh.to(tl.int64) * q_len
    lse, delta = _row_stats(Lse + row0, Delta + row0, offs_m, q_len, True)
    K += off_z * stride_kz + off_kvh * stride_kh
    V += off_z * stride_vz + off_kvh * stride_vh
    Bad += (off_z * (num_heads // group_size) + off_kvh) * kv_len
    Bias += off_z * stride_bz + off_h * stride_bh
    DBias += row0 * kv_len
    if HAS_DISTANCE:  # at the head's entry of j == i
        Distance = distance_row(Distance, off_h, q_len, kv_len)
    if DISTANCE_GRAD:
        DDistance = distance_rows(DDistance, pid_zh, pid_m, kv_len, BLOCK_M, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    drop_key = 0
    if DROPOUT:
        drop_key = row_key(Word, pid_zh)

    for part in tl.static_range(3):  # masked head, mask-free middle, masked tail
        if not (HAS_TABLE and part == 0):  # a table lists no head
            tiles, lo, hi = tile_span(row, num_cols, part, t_lo, u_lo, u_hi, t_hi, BLOCK_N,
                                      HAS_TABLE)
            dq = _dq_tiles(
                dq, q, do, lse, delta, K, V, Bad, Bits, Bias, DBias, Distance, DDistance, tiles,
                lo, hi, num_cols, offs_m, offs_d, offs_dv, stride_kn, stride_kd, stride_vn,
                stride_vd, stride_bm, stride_bn, q_len, kv_len, kv_valid, head_dim,
                value_head_dim, sm_scale, softcap, lower_off, upper_off, drop_key,
                drop_threshold, drop_scale, part != 1, BLOCK_M, BLOCK_N, EVEN_D, HAS_LOWER,
                HAS_UPPER, HAS_BAD, HAS_BITS, HAS_BIAS, HAS_DISTANCE, HAS_TABLE, BIAS_GRAD,
                DISTANCE_GRAD, SOFTCAP, INPUT_PRECISION, DROPOUT)

    dq_ptrs = (DQ + off_z * stride_dqz + off_h * stride_dqh + offs_m[:, None] * stride_dqm
               + offs_d[None, :] * stride_dqd)
    dq = (dq * sm_scale).to(DQ.dtype.element_ty)
    if EVEN_D:
        tl.store(dq_ptrs, dq, mask=in_q[:, None])
    else:
        tl.store(dq_ptrs, dq, mask=in_q[:, None] & (offs_d[None, :] < head_dim))
