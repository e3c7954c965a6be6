"""The forward kernel for Hopper: tiles move through tensor descriptors (TMA).

The same algorithm as :mod:`._triton_kernel` (the block form's table rows, the masks
and the online softmax are shared with it), but Q, K, V and the output travel through tensor
descriptors over the four-dimensional ``(Z, H, L, D)`` tensors: on sm_90 Triton turns
their loads into bulk tensor copies (``cp.async.bulk.tensor``) that the copy engine
runs while the warps compute, and feeds the tiles from shared memory to ``wgmma``.
Rows past ``L`` and columns past ``D`` read as zeros and are not written, so neither
uneven head dims nor ragged ends need masks on the loads. ``WARP_SPECIALIZE`` splits
the key loop into producer and consumer warps where the installed Triton supports it.

Descriptors need a unit inner stride and 16-byte aligned outer strides; the launcher
keeps the pointer kernel for anything else.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_distance import distance_row
from ._triton_kernel import block_order, finish_rows, fold_tile
from ._triton_masks import bias_tile, tile_slot, tile_span, tile_start
from ._triton_walk import key_walk

__all__ = ["flash_forward_tma_kernel"]


@triton.jit
def _attend_tma(acc, l_i, m_i, q, DescK, DescV, Poison, Bits, Bias, Distance, off_z, off_kvh,
                offs_m, tiles, lo, hi, num_cols, q_len, kv_len, kv_valid, stride_bm, stride_bn,
                sm_scale, softcap, lower_off, upper_off, MASKED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
                HAS_POISON: tl.constexpr, HAS_BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_DISTANCE: tl.constexpr, HAS_TABLE: tl.constexpr, SOFTCAP: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Fold the key blocks of ``range(lo, hi, BLOCK_N)`` (see ``tile_span``) into the
    running state, loading through descriptors."""
    offs_n = tl.arange(0, BLOCK_N)
    for pos in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tile_start(tiles, pos, BLOCK_N, HAS_TABLE)
        k = DescK.load([off_z, off_kvh, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        v = DescV.load([off_z, off_kvh, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        cols = start_n + offs_n
        poison = 0.0
        slot = 0
        bias = 0.0
        if MASKED:  # boxes load whole: values past the key length (and poisoned ones)
            # are zeroed, as their weight 0 would meet a NaN there as 0 * NaN
            ok = cols < kv_valid
            if HAS_POISON:
                poison = tl.load(Poison + cols, mask=ok, other=0.0)
                ok &= poison == 0.0
            v = tl.where(ok[:, None], v, tl.zeros_like(v))
            if HAS_BITS:
                slot = tile_slot(tiles, num_cols, pos, BLOCK_N)
        if HAS_BIAS:
            bias = bias_tile(Bias, offs_m[:, None], cols[None, :], q_len, kv_len, stride_bm,
                             stride_bn)
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, q, tl.trans(k), v, offs_m, cols, kv_valid,
                                  lower_off, upper_off, Bits, slot, bias, Distance, poison,
                                  sm_scale, softcap, 0, 0, 1.0, MASKED, HAS_LOWER, HAS_UPPER,
                                  HAS_BITS, HAS_BIAS, HAS_DISTANCE, HAS_POISON, SOFTCAP,
                                  INPUT_PRECISION, BLOCK_M, BLOCK_N,
                                  False)  # no dropout: the launch takes the pointer path
    return acc, l_i, m_i


@triton.jit
def flash_forward_tma_kernel(
        DescQ, DescK, DescV, DescO, Lse, KeyLengths, QueryLengths, Poison, Table, Bits, Bias,
        Distance, stride_bz, stride_bh, stride_bm, stride_bn,
        table_z, table_h, table_m, num_cols,
        num_heads, group_size, q_len, kv_len,
        sm_scale, softcap, lower_off, upper_off,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
        HAS_KEY_LENGTHS: tl.constexpr, HAS_QUERY_LENGTHS: tl.constexpr,
        HAS_POISON: tl.constexpr, HAS_BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_DISTANCE: tl.constexpr, HAS_TABLE: tl.constexpr, SOFTCAP: tl.constexpr,
        REVERSE: tl.constexpr, INPUT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Grid ``(Z * num_heads * cdiv(q_len, BLOCK_M),)`` (see :func:`block_order`). The
    descriptors' block shapes are ``[1, 1, BLOCK_M or BLOCK_N, BLOCK_D or BLOCK_DV]``;
    the other arguments as for the pointer kernel."""
    pid_zh, pid_m = block_order(num_heads, q_len, BLOCK_M, REVERSE)
    off_z = pid_zh // num_heads
    off_h = pid_zh % num_heads
    off_kvh = off_h // group_size  # grouped-query: K/V head shared by the group

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    kv_valid, q_valid, row, t_lo, u_lo, u_hi, t_hi = key_walk(
        Table, KeyLengths, QueryLengths, off_z, off_h, pid_m, m0, q_len, kv_len, table_z,
        table_h, table_m, lower_off, upper_off, BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER,
        HAS_KEY_LENGTHS, HAS_QUERY_LENGTHS, HAS_TABLE)

    q = DescQ.load([off_z, off_h, m0, 0]).reshape(BLOCK_M, BLOCK_D)
    Poison += (off_z * (num_heads // group_size) + off_kvh).to(tl.int64) * kv_len
    Bias += off_z.to(tl.int64) * stride_bz + off_h.to(tl.int64) * stride_bh
    if HAS_DISTANCE:  # at the head's entry of j == i
        Distance = distance_row(Distance, off_h.to(tl.int64), q_len, kv_len)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Masked head, mask-free middle (the loop warp specialization may split), masked
    # tail; a table lists no head.
    for part in tl.static_range(3):
        if not (HAS_TABLE and part == 0):
            tiles, lo, hi = tile_span(row, num_cols, part, t_lo, u_lo, u_hi, t_hi, BLOCK_N,
                                      HAS_TABLE)
            acc, l_i, m_i = _attend_tma(
                acc, l_i, m_i, q, DescK, DescV, Poison, Bits, Bias, Distance, off_z, off_kvh,
                offs_m, tiles, lo, hi, num_cols, q_len, kv_len, kv_valid, stride_bm, stride_bn,
                sm_scale, softcap, lower_off, upper_off, part != 1, BLOCK_M, BLOCK_N, BLOCK_D,
                BLOCK_DV, HAS_LOWER, HAS_UPPER, HAS_POISON, HAS_BITS, HAS_BIAS, HAS_DISTANCE,
                HAS_TABLE, SOFTCAP, INPUT_PRECISION, WARP_SPECIALIZE and part == 1)

    out, lse = finish_rows(acc, l_i, m_i, offs_m, q_valid)
    tl.store(Lse + pid_zh.to(tl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)
    DescO.store([off_z, off_h, m0, 0],
                out.to(DescO.dtype).reshape(1, 1, BLOCK_M, BLOCK_DV))
