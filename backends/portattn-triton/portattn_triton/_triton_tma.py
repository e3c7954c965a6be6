"""The forward kernel for Hopper: tiles move through tensor descriptors (TMA).

The same algorithm as :mod:`._triton_kernel` (the band, the three stages, the online
softmax are shared with it), but Q, K, V and the output travel through tensor
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

from ._triton_kernel import block_order, finish_rows, fold_tile, key_tiles, valid_lengths

__all__ = ["flash_forward_tma_kernel"]


@triton.jit
def _attend_tma(acc, l_i, m_i, q, DescK, DescV, Poison, off_z, off_kvh, offs_m, lo, hi,
                kv_valid, sm_scale, softcap, lower_off, upper_off, MASKED: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr, HAS_POISON: tl.constexpr,
                SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                WARP_SPECIALIZE: tl.constexpr):
    """Fold key blocks ``[lo, hi)`` into the running state, loading through descriptors."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = DescK.load([off_z, off_kvh, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        v = DescV.load([off_z, off_kvh, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        poison = 0.0
        if MASKED:  # boxes load whole: values past the key length (and poisoned ones)
            # are zeroed, as their weight 0 would meet a NaN there as 0 * NaN
            ok = start_n + offs_n < kv_valid
            if HAS_POISON:
                poison = tl.load(Poison + start_n + offs_n, mask=ok, other=0.0)
                ok &= poison == 0.0
            v = tl.where(ok[:, None], v, tl.zeros_like(v))
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, q, tl.trans(k), v, start_n + offs_n, offs_m,
                                  kv_valid, poison, sm_scale, softcap, lower_off, upper_off,
                                  MASKED, HAS_LOWER, HAS_UPPER, HAS_POISON, SOFTCAP,
                                  INPUT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def flash_forward_tma_kernel(
        DescQ, DescK, DescV, DescO, Lse, KeyLengths, QueryLengths, Poison,
        num_heads, group_size, q_len, kv_len,
        sm_scale, softcap, lower_off, upper_off,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
        HAS_KEY_LENGTHS: tl.constexpr, HAS_QUERY_LENGTHS: tl.constexpr,
        HAS_POISON: tl.constexpr, SOFTCAP: tl.constexpr, REVERSE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Grid ``(Z * num_heads * cdiv(q_len, BLOCK_M),)`` (see :func:`block_order`). The
    descriptors' block shapes are ``[1, 1, BLOCK_M or BLOCK_N, BLOCK_D or BLOCK_DV]``."""
    pid_zh, pid_m = block_order(num_heads, q_len, BLOCK_M, REVERSE)
    off_z = pid_zh // num_heads
    off_h = pid_zh % num_heads
    off_kvh = off_h // group_size  # grouped-query: K/V head shared by the group

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    kv_valid, q_valid = valid_lengths(KeyLengths, QueryLengths, off_z, q_len, kv_len,
                                      HAS_KEY_LENGTHS, HAS_QUERY_LENGTHS)
    t_lo, u_lo, u_hi, t_hi = key_tiles(m0, q_valid, kv_valid, lower_off, upper_off,
                                       BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER)

    q = DescQ.load([off_z, off_h, m0, 0]).reshape(BLOCK_M, BLOCK_D)
    Poison += (off_z * (num_heads // group_size) + off_kvh).to(tl.int64) * kv_len
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Masked head, mask-free middle, masked tail (see key_tiles).
    acc, l_i, m_i = _attend_tma(
        acc, l_i, m_i, q, DescK, DescV, Poison, off_z, off_kvh, offs_m, t_lo, u_lo, kv_valid,
        sm_scale, softcap, lower_off, upper_off, True, BLOCK_N, BLOCK_D, BLOCK_DV,
        HAS_LOWER, HAS_UPPER, HAS_POISON, SOFTCAP, INPUT_PRECISION, False)
    acc, l_i, m_i = _attend_tma(
        acc, l_i, m_i, q, DescK, DescV, Poison, off_z, off_kvh, offs_m, u_lo, u_hi, kv_valid,
        sm_scale, softcap, lower_off, upper_off, False, BLOCK_N, BLOCK_D, BLOCK_DV,
        HAS_LOWER, HAS_UPPER, HAS_POISON, SOFTCAP, INPUT_PRECISION, WARP_SPECIALIZE)
    acc, l_i, m_i = _attend_tma(
        acc, l_i, m_i, q, DescK, DescV, Poison, off_z, off_kvh, offs_m, u_hi, t_hi, kv_valid,
        sm_scale, softcap, lower_off, upper_off, True, BLOCK_N, BLOCK_D, BLOCK_DV,
        HAS_LOWER, HAS_UPPER, HAS_POISON, SOFTCAP, INPUT_PRECISION, False)

    out, lse = finish_rows(acc, l_i, m_i, offs_m, q_valid)
    tl.store(Lse + pid_zh.to(tl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)
    DescO.store([off_z, off_h, m0, 0],
                out.to(DescO.dtype).reshape(1, 1, BLOCK_M, BLOCK_DV))
