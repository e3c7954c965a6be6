"""Split-KV decode: few queries against a long key cache.

A decode step has one to a few queries per head, so the forward kernel's grid (one
program per query block) would leave most of the GPU idle while each program walks all
the keys. Here one program takes one K/V head and one slice ("split") of the keys, and
all the query rows that read that head (every query head of the grouped-query group,
every query position) are packed into one tile: row ``r`` is query head
``kv_head * group + r // q_len`` at position ``r % q_len``, so K/V are read once per
group. Each split writes a float32 partial output and its log-sum-exp; the merge
kernel combines the splits by log-sum-exp weights (the identity behind
``portattn.merge``) into the output.

Importing this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_kernel import LOG2E, finish_rows, fold_tile, valid_lengths

__all__ = ["decode_merge_kernel", "decode_split_kernel"]


@triton.jit
def decode_split_kernel(
        Q, K, V, PartOut, PartLse, KeyLengths, QueryLengths, Poison,
        stride_qz, stride_qh, stride_qm, stride_qd,
        stride_kz, stride_kh, stride_kn, stride_kd,
        stride_vz, stride_vh, stride_vn, stride_vd,
        num_kv_heads, group_size, q_len, kv_len, head_dim, value_head_dim, split_len,
        sm_scale, softcap, lower_off, upper_off,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_LOWER: tl.constexpr,
        HAS_UPPER: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
        HAS_QUERY_LENGTHS: tl.constexpr, HAS_POISON: tl.constexpr, SOFTCAP: tl.constexpr,
        INPUT_PRECISION: tl.constexpr):
    """Grid ``(Z * num_kv_heads, num_splits)``. ``PartOut`` is
    ``(Z * num_kv_heads, num_splits, BLOCK_M, BLOCK_DV)`` float32, ``PartLse``
    ``(Z * num_kv_heads, num_splits, BLOCK_M)``; split ``s`` covers keys
    ``[s * split_len, (s + 1) * split_len)``."""
    pid_zh = tl.program_id(0)
    split = tl.program_id(1)
    off_z = (pid_zh // num_kv_heads).to(tl.int64)
    off_kvh = (pid_zh % num_kv_heads).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    head = off_kvh * group_size + rows // q_len
    pos = rows % q_len  # the query index of each packed row: the band is on j - pos
    in_rows = rows < group_size * q_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)

    kv_valid, q_valid = valid_lengths(KeyLengths, QueryLengths, off_z, q_len, kv_len,
                                      HAS_KEY_LENGTHS, HAS_QUERY_LENGTHS)
    # Keys any packed row may reach, within this split.
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_valid)
    if HAS_LOWER:
        lo = tl.maximum(lo, (lower_off // BLOCK_N) * BLOCK_N)
    if HAS_UPPER:
        hi = tl.minimum(hi, q_valid - 1 + upper_off + 1)

    q_ptrs = (Q + off_z * stride_qz + head[:, None] * stride_qh + pos[:, None] * stride_qm
              + offs_d[None, :] * stride_qd)
    q_mask = in_rows[:, None] & (offs_d[None, :] < head_dim)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    K += off_z * stride_kz + off_kvh * stride_kh
    V += off_z * stride_vz + off_kvh * stride_vh
    Poison += pid_zh.to(tl.int64) * kv_len

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        in_k = cols < hi
        k_other = 0.0
        if HAS_POISON:  # poisoned keys load as NaN, their values as 0
            poison = tl.load(Poison + cols, mask=in_k, other=0.0)
            k_other = poison[None, :]
            in_k &= poison == 0.0
        k_ptrs = K + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_ptrs = V + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        if EVEN_D:
            k = tl.load(k_ptrs, mask=in_k[None, :], other=k_other)
            v = tl.load(v_ptrs, mask=in_k[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=in_k[None, :] & (offs_d[:, None] < head_dim),
                        other=k_other)
            v = tl.load(v_ptrs, mask=in_k[:, None] & (offs_dv[None, :] < value_head_dim),
                        other=0.0)
        # Every tile is masked: its keys stop at hi, and each row has its own band.
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, q, k, v, cols, pos, hi, 0.0, sm_scale,
                                  softcap, lower_off, upper_off, True, HAS_LOWER,
                                  HAS_UPPER, False, SOFTCAP, INPUT_PRECISION)

    out, lse = finish_rows(acc, l_i, m_i, pos, tl.where(in_rows, q_valid, 0))
    part = pid_zh.to(tl.int64) * tl.num_programs(1) + split
    tl.store(PartLse + part * BLOCK_M + rows, lse)
    tl.store(PartOut + part * BLOCK_M * BLOCK_DV + rows[:, None] * BLOCK_DV
             + offs_dv[None, :], out)


@triton.jit
def decode_merge_kernel(
        PartOut, PartLse, Out, Lse, stride_oz, stride_oh, stride_om, stride_od,
        num_kv_heads, num_heads, group_size, q_len, value_head_dim, num_splits,
        BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid ``(Z * num_kv_heads,)``: out = sum_s w_s o_s / sum_s w_s with
    ``w_s = exp(lse_s - max lse)``; lse = max + log(sum w). Splits that saw no key
    have lse -inf and weight 0; rows no split saw give 0 and -inf; a row with a NaN
    lse in any split is NaN (whether ``tl.max`` skips NaN or not)."""
    pid_zh = tl.program_id(0).to(tl.int64)
    off_z = pid_zh // num_kv_heads
    off_kvh = pid_zh % num_kv_heads
    rows = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    splits = tl.arange(0, BLOCK_S)
    base = pid_zh * num_splits

    lse_ptrs = PartLse + (base + splits[:, None]) * BLOCK_M + rows[None, :]
    lses = tl.load(lse_ptrs, mask=splits[:, None] < num_splits, other=float("-inf"))
    nan_row = tl.max((lses != lses).to(tl.int32), 0) > 0
    top = tl.max(lses, 0)
    seen = (top > float("-inf")) | nan_row
    top_safe = tl.where(seen, top, 0.0)
    weights = tl.math.exp2((lses - top_safe[None, :]) * LOG2E)  # [BLOCK_S, BLOCK_M]
    total = tl.sum(weights, 0)
    total_safe = tl.where(seen, total, 1.0)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for s in range(num_splits):
        w = tl.load(PartLse + (base + s) * BLOCK_M + rows)
        w = tl.where(seen, tl.math.exp2((w - top_safe) * LOG2E), 0.0)
        o = tl.load(PartOut + (base + s) * BLOCK_M * BLOCK_DV + rows[:, None] * BLOCK_DV
                    + offs_dv[None, :])
        acc += w[:, None] * o
    out = tl.where(seen[:, None], acc / total_safe[:, None], 0.0)
    lse = tl.where(seen, top_safe + tl.log(total_safe), float("-inf"))

    head = off_kvh * group_size + rows // q_len
    pos = rows % q_len
    in_rows = rows < group_size * q_len
    o_ptrs = (Out + off_z * stride_oz + head[:, None] * stride_oh + pos[:, None] * stride_om
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=in_rows[:, None] & (offs_dv[None, :] < value_head_dim))
    tl.store(Lse + (off_z * num_heads + head) * q_len + pos, lse, mask=in_rows)
