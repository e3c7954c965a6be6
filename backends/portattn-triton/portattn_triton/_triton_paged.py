"""Split-KV decode over paged keys and values: a few queries per sequence against that
sequence's keys, read in place through its block table.

One program takes one sequence, one K/V head and one slice ("split") of the sequence's
keys; every query row that reads the head (each query head of its group, each of the
sequence's queries) is packed into one tile, row ``r`` being query head
``kv_head * group + r // max_queries`` at the sequence's query ``r % max_queries``. A
key block's rows are found through the block table (page ``table[j // page]``, row
``j % page``) and loaded where they lie, so no gathered copy of any sequence is made.
The mask, of causal and window parts, is a band on ``j - position`` (a query's
position: its index among the sequence's last ``count`` positions); ALiBi slopes and a
softcap change the scores. Each split writes a float32 partial output and log-sum-exp,
which :func:`~portattn_triton._triton_decode.decode_merge_kernel` joins.

A value that is not finite makes NaN only the rows that attend its key (its block's
values are read as 0 and the rows that see it marked); key slots past a sequence's
length are never loaded.

Importing this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_kernel import LOG2E, finish_rows

__all__ = ["paged_split_kernel"]


@triton.jit
def paged_split_kernel(
        Q, K, V, PartOut, PartLse, Table, Starts, Lengths, Slopes,
        stride_qt, stride_qh, stride_qd,
        stride_kp, stride_ks, stride_kh, stride_kd,
        stride_vp, stride_vs, stride_vh, stride_vd,
        stride_table, stride_slopes,
        num_kv_heads, group_size, max_queries, page_size, split_len, head_dim,
        value_head_dim, sm_scale, softcap, lower_off, upper_off,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
        HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Grid ``(S * num_kv_heads, num_splits)``. ``PartOut`` is
    ``(S * num_kv_heads, num_splits, BLOCK_M, BLOCK_DV)`` float32, ``PartLse``
    ``(S * num_kv_heads, num_splits, BLOCK_M)``. The pools' strides are given as
    (page, row in page, head, dim), which covers both layouts."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    seq = (pid // num_kv_heads).to(tl.int64)
    kv_head = (pid % num_kv_heads).to(tl.int64)
    start = tl.load(Starts + seq)
    count = tl.load(Starts + seq + 1) - start
    length = tl.load(Lengths + seq)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * group_size + rows // max_queries
    index = rows % max_queries
    in_rows = (rows < group_size * max_queries) & (index < count)
    position = length - count + index  # bottom-right aligned: the last positions
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(Q + (start + index)[:, None].to(tl.int64) * stride_qt
                + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=in_rows[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + seq * stride_slopes + head, mask=in_rows, other=0.0)
    # this split's keys, narrowed to those the band lets the sequence's queries see
    lo = split * split_len
    hi = tl.minimum(lo + split_len, length)
    if HAS_LOWER:
        lo = tl.maximum(lo, length - count + lower_off)
    if HAS_UPPER:
        hi = tl.minimum(hi, length + upper_off)
    lo = tl.maximum(lo, 0)
    hi = tl.where(count > 0, hi, lo)  # a sequence with no query this call reads nothing
    table = Table + seq * stride_table

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    poisoned = tl.zeros([BLOCK_M], dtype=tl.int32)
    for j0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        cols = j0 + offs_n
        valid = (cols >= lo) & (cols < hi)
        page = tl.load(table + cols // page_size, mask=valid, other=0).to(tl.int64)
        slot = (cols % page_size).to(tl.int64)
        k = tl.load(K + page[:, None] * stride_kp + slot[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                    mask=valid[:, None] & (offs_d[None, :] < head_dim), other=0.0)
        v = tl.load(V + page[:, None] * stride_vp + slot[:, None] * stride_vs
                    + kv_head * stride_vh + offs_dv[None, :] * stride_vd,
                    mask=valid[:, None] & (offs_dv[None, :] < value_head_dim), other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if SOFTCAP:  # softcap * tanh(x), tanh through exp2, in log2 units
            x = qk * (sm_scale / softcap)
            s = (1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)) * (softcap * LOG2E)
        else:
            s = qk * (sm_scale * LOG2E)
        offset = cols[None, :] - position[:, None]
        if HAS_ALIBI:
            s -= slope[:, None] * tl.abs(offset).to(tl.float32) * LOG2E
        allowed = valid[None, :] & in_rows[:, None]
        if HAS_LOWER:
            allowed &= offset >= lower_off
        if HAS_UPPER:
            allowed &= offset <= upper_off
        s = tl.where(allowed, s, float("-inf"))
        finite = tl.abs(v) < float("inf")  # False for NaN too
        bad = tl.max((~finite).to(tl.int32), 1)  # [BLOCK_N] keys with such a value
        poisoned |= tl.max(tl.where(allowed, bad[None, :], 0), 1)
        v = tl.where(finite, v, 0.0)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    out, lse = finish_rows(acc, l_i, m_i, rows, BLOCK_M)
    out = tl.where(poisoned[:, None] > 0, float("nan"), out)
    lse = tl.where(poisoned > 0, float("nan"), lse)
    part = pid.to(tl.int64) * tl.num_programs(1) + split
    tl.store(PartLse + part * BLOCK_M + rows, lse)
    tl.store(PartOut + part * BLOCK_M * BLOCK_DV + rows[:, None] * BLOCK_DV
             + offs_dv[None, :], out)
