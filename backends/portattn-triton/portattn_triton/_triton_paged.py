"""Paged attention: packed queries of many sequences (prefill chunks and single-token
decodes alike) against each sequence's keys, read in place through its block table.

The host cuts each sequence's queries into query tiles (:mod:`._paged_tiles`); one
program takes one tile, one K/V head and one slice ("split") of the keys the tile's
band lets it see. Every query row of the tile that reads the head is packed into one
``BLOCK_M`` tile: row ``r`` is query head ``kv_head * group + head0 + r // tile_queries``
at the tile's query ``r % tile_queries``, so K/V are read once per group. A key
block's rows are found through the block table (page ``table[j // page]``, row
``j % page``) and loaded where they lie, so no gathered copy of any sequence is made.
The mask, of causal and window parts, is a band on ``j - position`` (a query's
position: its index among the sequence's last positions); ALiBi slopes and a softcap
change the scores. A tile's only split writes the packed output ``(T, Hq, Dv)`` and
lse ``(Hq, T)`` itself, learned sinks joined; the splits of a longer range write
float32 partial results, which :func:`paged_merge_kernel` joins
(:func:`~._triton_decode.merge_parts`) and stores the same way.

A value that is not finite makes NaN only the rows that attend its key (the value is
read as 0 and its key scores NaN before the mask, so the rows the mask hides from it
stay clean); key slots past a sequence's length are never loaded.

Importing this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._paged_tiles import ITEM_FIELDS as _ITEM_FIELDS
from ._paged_tiles import MERGE_FIELDS as _MERGE_FIELDS
from ._triton_decode import merge_parts
from ._triton_kernel import LOG2E, finish_rows

__all__ = ["paged_merge_kernel", "paged_tile_kernel"]

ITEM_FIELDS: tl.constexpr = tl.constexpr(_ITEM_FIELDS)
MERGE_FIELDS: tl.constexpr = tl.constexpr(_MERGE_FIELDS)


@triton.jit
def tile_rows(head0, count, kv_head, group_size, tile_heads, tile_queries,
              BLOCK_M: tl.constexpr):
    """``(head, index, in_rows)`` of a tile's packed rows: each row's query head, its
    query's index within the tile, and whether it holds a query at all."""
    rows = tl.arange(0, BLOCK_M)
    within = rows // tile_queries  # the row's head among the tile's
    index = rows % tile_queries
    in_group = head0 + within
    in_rows = (within < tile_heads) & (in_group < group_size) & (index < count)
    return kv_head * group_size + in_group, index, in_rows


@triton.jit
def store_rows(Out, Lse, Sinks, out, lse, seq, query, head, in_rows, num_heads,
               value_head_dim, stride_ot, stride_oh, stride_od, stride_lh,
               BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Store a tile's rows at their packed ``query`` and ``head``, each head's sink
    logit joined to the row's denominator first."""
    if HAS_SINKS:
        sink = tl.load(Sinks + seq * num_heads + head, mask=in_rows, other=0.0)
        top = tl.maximum(lse, sink)
        top = tl.where(top == float("-inf"), 0.0, top)  # both -inf: no mass at all
        joined = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
        scale = tl.where(joined == float("-inf"), 0.0, tl.exp(lse - joined))
        out = out * scale[:, None]
        lse = joined
    offs_dv = tl.arange(0, BLOCK_DV)
    query = query.to(tl.int64)
    o_ptrs = (Out + query[:, None] * stride_ot + head[:, None] * stride_oh
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=in_rows[:, None] & (offs_dv[None, :] < value_head_dim))
    tl.store(Lse + head * stride_lh + query, lse, mask=in_rows)


@triton.jit
def paged_tile_kernel(
        Q, K, V, Out, Lse, PartOut, PartLse, Items, Table, Slopes, Sinks,
        stride_qt, stride_qh, stride_qd,
        stride_kp, stride_ks, stride_kh, stride_kd,
        stride_vp, stride_vs, stride_vh, stride_vd,
        stride_ot, stride_oh, stride_od, stride_lh, stride_table,
        group_size, tile_heads, tile_queries, page_size, head_dim, value_head_dim,
        sm_scale, softcap, lower_off, upper_off,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
        HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
        INPUT_PRECISION: tl.constexpr):
    """Grid ``(len(Items), num_kv_heads)``. ``Items`` rows are described in
    :mod:`._paged_tiles`; ``PartOut`` is ``(parts, num_kv_heads, BLOCK_M, BLOCK_DV)``
    float32 and ``PartLse`` ``(parts, num_kv_heads, BLOCK_M)``; ``Slopes`` and
    ``Sinks`` are ``(S, Hq)`` float32, contiguous. The pools' strides are given as
    (page, row in page, head, dim), which covers both layouts."""
    item = Items + tl.program_id(0).to(tl.int64) * ITEM_FIELDS
    kv_head = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1) * group_size
    seq = tl.load(item).to(tl.int64)
    first = tl.load(item + 1)
    count = tl.load(item + 2)
    position0 = tl.load(item + 3)
    lo = tl.load(item + 5)
    hi = tl.load(item + 6)  # this split's keys, within the tile's band and length
    part = tl.load(item + 7)

    head, index, in_rows = tile_rows(tl.load(item + 4), count, kv_head, group_size,
                                     tile_heads, tile_queries, BLOCK_M)
    position = position0 + index
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(Q + (first + index)[:, None].to(tl.int64) * stride_qt
                + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=in_rows[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + seq * num_heads + head, mask=in_rows, other=0.0)
    table = Table + seq * stride_table

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
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
        # a key whose value is not finite scores NaN in the rows that see it (its value
        # read as 0, so that rows that do not see it stay clean)
        finite = tl.abs(v) < float("inf")  # False for NaN too
        bad = tl.min(finite.to(tl.int32), 1) == 0
        s += tl.where(bad, float("nan"), 0.0)[None, :]
        v = tl.where(finite, v, 0.0)
        allowed = valid[None, :]  # padding rows compute, and are never stored
        if HAS_LOWER:
            allowed &= offset >= lower_off
        if HAS_UPPER:
            allowed &= offset <= upper_off
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    out, lse = finish_rows(acc, l_i, m_i, rows, BLOCK_M)
    if part < 0:  # the tile's only split: its rows are final
        store_rows(Out, Lse, Sinks, out, lse, seq, first + index, head, in_rows, num_heads,
                   value_head_dim, stride_ot, stride_oh, stride_od, stride_lh, BLOCK_DV,
                   HAS_SINKS)
    else:
        at = part.to(tl.int64) * tl.num_programs(1) + kv_head
        tl.store(PartLse + at * BLOCK_M + rows, lse)
        tl.store(PartOut + at * BLOCK_M * BLOCK_DV + rows[:, None] * BLOCK_DV
                 + offs_dv[None, :], out)


@triton.jit
def paged_merge_kernel(
        PartOut, PartLse, Out, Lse, Merges, Sinks,
        stride_ot, stride_oh, stride_od, stride_lh,
        group_size, tile_heads, tile_queries, value_head_dim,
        BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Grid ``(len(Merges), num_kv_heads)``: the splits of a tile (a row of ``Merges``,
    see :mod:`._paged_tiles`) merged and stored as :func:`paged_tile_kernel` stores a
    tile's only split."""
    tile = Merges + tl.program_id(0).to(tl.int64) * MERGE_FIELDS
    kv_head = tl.program_id(1).to(tl.int64)
    num_kv_heads = tl.num_programs(1)
    seq = tl.load(tile).to(tl.int64)
    first = tl.load(tile + 1)
    count = tl.load(tile + 2)
    part0 = tl.load(tile + 4).to(tl.int64)
    splits = tl.load(tile + 5)
    head, index, in_rows = tile_rows(tl.load(tile + 3), count, kv_head, group_size,
                                     tile_heads, tile_queries, BLOCK_M)
    out, lse = merge_parts(PartOut, PartLse, part0 * num_kv_heads + kv_head, num_kv_heads,
                           splits, BLOCK_M, BLOCK_DV)
    store_rows(Out, Lse, Sinks, out, lse, seq, first + index, head, in_rows,
               num_kv_heads * group_size, value_head_dim, stride_ot, stride_oh, stride_od,
               stride_lh, BLOCK_DV, HAS_SINKS)
