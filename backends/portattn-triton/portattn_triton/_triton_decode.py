"""Split-KV decode: few queries against a long key cache.

A decode step has one to a few queries per head, so the forward kernel's grid (one
program per query block) would leave most of the GPU idle while each program walks all
the keys. Here one program takes one K/V head and one slice ("split") of the keys, and
all the query rows that read that head (every query head of the grouped-query group,
every query position) are packed into one tile: row ``r`` is query head
``kv_head * group + r // q_len`` at position ``r % q_len``, so K/V are read once per
group. Each split writes a float32 partial output and its log-sum-exp; the merge
kernel combines the splits by log-sum-exp weights (the identity behind
``portattn.merge``) into the output. The key blocks of a split come from the block
form (one table row per split, the query heads of the group merged): full ones with
no mask, partial ones masked per row (its own query index, head and bit tile row).

Importing this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_distance import distance_row
from ._triton_kernel import LOG2E, finish_rows, fold_tile, keys_and_values
from ._triton_masks import bias_tile, table_row
from ._triton_walk import valid_lengths

__all__ = ["decode_merge_kernel", "decode_split_kernel", "merge_parts"]


@triton.jit
def _attend_split(acc, l_i, m_i, q, K, V, Poison, Bits, Bias, Distance, tiles, count, num_cols,
                  rows, pos, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd,
                  stride_bm, stride_bn, q_len, kv_len, kv_valid, head_dim, value_head_dim,
                  sm_scale, softcap, lower_off, upper_off, MASKED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
                  HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr, HAS_POISON: tl.constexpr,
                  HAS_BITS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DISTANCE: tl.constexpr,
                  SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Fold the ``count`` key blocks listed at ``tiles`` into the packed rows' state.
    ``Bias`` and ``Distance`` point at each row's head (``[BLOCK_M, 1]`` pointers)."""
    offs_n = tl.arange(0, BLOCK_N)
    for i in range(count):
        cols = tl.load(tiles + i) * BLOCK_N + offs_n
        # poisoned keys load as NaN; with a bias, which may hide them, the poison joins
        # the scores instead
        k, v, poison = keys_and_values(K, V, Poison, cols, offs_d, offs_dv, stride_kn,
                                       stride_kd, stride_vn, stride_vd, kv_valid, head_dim,
                                       value_head_dim, MASKED, EVEN_D, HAS_POISON,
                                       HAS_POISON and HAS_BIAS)
        slot = 0
        bias = 0.0
        if MASKED and HAS_BITS:
            slot = tl.load(tiles + num_cols + i)
        if HAS_BIAS:
            bias = bias_tile(Bias, pos[:, None], cols[None, :], q_len, kv_len, stride_bm,
                             stride_bn)
        # Each packed row has its own query index: the band is on j - pos.
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, q, k, v, pos, cols, kv_valid, lower_off,
                                  upper_off, Bits, slot, bias, Distance, poison, sm_scale,
                                  softcap, 0, 0, 1.0, MASKED, HAS_LOWER, HAS_UPPER, HAS_BITS,
                                  HAS_BIAS, HAS_DISTANCE, HAS_POISON and HAS_BIAS, SOFTCAP,
                                  INPUT_PRECISION, BLOCK_M, BLOCK_N,
                                  False)  # no dropout: the launch takes the pointer path
    return acc, l_i, m_i


@triton.jit
def decode_split_kernel(
        Q, K, V, PartOut, PartLse, KeyLengths, QueryLengths, Poison, Table, Bits, Bias,
        Distance, stride_qz, stride_qh, stride_qm, stride_qd,
        stride_kz, stride_kh, stride_kn, stride_kd,
        stride_vz, stride_vh, stride_vn, stride_vd,
        stride_bz, stride_bh, stride_bm, stride_bn,
        table_z, table_h, table_s, num_cols,
        num_kv_heads, group_size, q_len, kv_len, head_dim, value_head_dim,
        sm_scale, softcap, lower_off, upper_off,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_LOWER: tl.constexpr,
        HAS_UPPER: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
        HAS_QUERY_LENGTHS: tl.constexpr, HAS_POISON: tl.constexpr, HAS_BITS: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_DISTANCE: tl.constexpr, SOFTCAP: tl.constexpr,
        INPUT_PRECISION: tl.constexpr):
    """Grid ``(Z * num_kv_heads, num_splits)``. ``PartOut`` is
    ``(Z * num_kv_heads, num_splits, BLOCK_M, BLOCK_DV)`` float32, ``PartLse``
    ``(Z * num_kv_heads, num_splits, BLOCK_M)``; ``Table`` has one row per split
    (its key blocks), ``Bits`` tiles of the packed rows."""
    pid_zh = tl.program_id(0)
    split = tl.program_id(1)
    off_z = (pid_zh // num_kv_heads).to(tl.int64)
    off_kvh = (pid_zh % num_kv_heads).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    head = off_kvh * group_size + rows // q_len
    pos = rows % q_len  # the query index of each packed row
    in_rows = rows < group_size * q_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    kv_valid, q_valid = valid_lengths(KeyLengths, QueryLengths, off_z, q_len, kv_len,
                                      HAS_KEY_LENGTHS, HAS_QUERY_LENGTHS)
    row = table_row(Table, off_z, off_kvh, split, table_z, table_h, table_s)

    q_ptrs = (Q + off_z * stride_qz + head[:, None] * stride_qh + pos[:, None] * stride_qm
              + offs_d[None, :] * stride_qd)
    q_mask = in_rows[:, None] & (offs_d[None, :] < head_dim)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    K += off_z * stride_kz + off_kvh * stride_kh
    V += off_z * stride_vz + off_kvh * stride_vh
    Poison += pid_zh.to(tl.int64) * kv_len
    # padding rows read the group's last head (their results are never stored)
    read_head = tl.minimum(head, (off_kvh + 1) * group_size - 1)[:, None]
    Bias += off_z * stride_bz + read_head * stride_bh
    if HAS_DISTANCE:  # at each row's head's entry of j == i
        Distance = distance_row(Distance, read_head, q_len, kv_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for part in tl.static_range(2):  # full tiles (no mask), then partial ones
        if part == 0:
            tiles, count = row + 2 + 2 * num_cols, tl.load(row + 1)
        else:
            tiles, count = row + 2, tl.load(row)
        acc, l_i, m_i = _attend_split(
            acc, l_i, m_i, q, K, V, Poison, Bits, Bias, Distance, tiles, count, num_cols, rows,
            pos, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_bm,
            stride_bn, q_len, kv_len, kv_valid, head_dim, value_head_dim, sm_scale, softcap,
            lower_off, upper_off, part == 1, BLOCK_M, BLOCK_N, EVEN_D, HAS_LOWER, HAS_UPPER,
            HAS_POISON, HAS_BITS, HAS_BIAS, HAS_DISTANCE, SOFTCAP, INPUT_PRECISION)

    out, lse = finish_rows(acc, l_i, m_i, pos, tl.where(in_rows, q_valid, 0))
    part = pid_zh.to(tl.int64) * tl.num_programs(1) + split
    tl.store(PartLse + part * BLOCK_M + rows, lse)
    tl.store(PartOut + part * BLOCK_M * BLOCK_DV + rows[:, None] * BLOCK_DV
             + offs_dv[None, :], out)


@triton.jit
def merge_parts(PartOut, PartLse, base, step, num_splits, BLOCK_M: tl.constexpr,
                BLOCK_DV: tl.constexpr):
    """``(out, lse)`` of ``BLOCK_M`` rows merged from ``num_splits`` partial results,
    split ``s`` at part ``base + s * step`` (``PartOut`` ``[part, BLOCK_M, BLOCK_DV]``,
    ``PartLse`` ``[part, BLOCK_M]``): out = sum_s w_s o_s / sum_s w_s with
    ``w_s = exp(lse_s - max lse)``; lse = max + log(sum w). Two passes over the splits
    (the max, then the sums), so no tile grows with their number. Splits that saw no
    key have lse -inf and weight 0; rows no split saw give 0 and -inf; a row with a
    NaN lse in any split is NaN (whether ``tl.maximum`` skips NaN or not)."""
    rows = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    nan_row = tl.zeros([BLOCK_M], dtype=tl.int32)
    for s in range(num_splits):
        lse = tl.load(PartLse + (base + s * step) * BLOCK_M + rows)
        nan_row |= (lse != lse).to(tl.int32)
        top = tl.maximum(top, lse)
    seen = (top > float("-inf")) | (nan_row > 0)
    # a NaN row whose max skipped the NaN may have top -inf: subtract 0 there, not -inf
    top_safe = tl.where(top > float("-inf"), top, 0.0)

    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for s in range(num_splits):
        part = base + s * step
        w = tl.load(PartLse + part * BLOCK_M + rows)
        w = tl.where(seen, tl.math.exp2((w - top_safe) * LOG2E), 0.0)
        o = tl.load(PartOut + part * BLOCK_M * BLOCK_DV + rows[:, None] * BLOCK_DV
                    + offs_dv[None, :])
        total += w
        acc += w[:, None] * o
    total_safe = tl.where(seen, total, 1.0)
    out = tl.where(seen[:, None], acc / total_safe[:, None], 0.0)
    lse = tl.where(seen, top_safe + tl.log(total_safe), float("-inf"))
    return out, lse


@triton.jit
def decode_merge_kernel(
        PartOut, PartLse, Out, Lse, stride_oz, stride_oh, stride_om, stride_od,
        num_kv_heads, num_heads, group_size, q_len, value_head_dim, num_splits,
        BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Grid ``(Z * num_kv_heads,)``: each packed row's splits merged
    (:func:`merge_parts`) and stored at its head and query."""
    pid_zh = tl.program_id(0).to(tl.int64)
    off_z = pid_zh // num_kv_heads
    off_kvh = pid_zh % num_kv_heads
    rows = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    out, lse = merge_parts(PartOut, PartLse, pid_zh * num_splits, 1, num_splits, BLOCK_M,
                           BLOCK_DV)

    head = off_kvh * group_size + rows // q_len
    pos = rows % q_len
    in_rows = rows < group_size * q_len
    o_ptrs = (Out + off_z * stride_oz + head[:, None] * stride_oh + pos[:, None] * stride_om
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=in_rows[:, None] & (offs_dv[None, :] < value_head_dim))
    tl.store(Lse + (off_z * num_heads + head) * q_len + pos, lse, mask=in_rows)
