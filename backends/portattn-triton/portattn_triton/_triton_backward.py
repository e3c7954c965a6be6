"""The flash-attention backward kernels (FlashAttention-2), written in Triton.

Probabilities are recomputed tile by tile from the saved log-sum-exp, never stored:
``P = exp(S - lse)``, ``dP = dO V^T``, ``dS = P * (dP - Delta)`` with
``Delta = rowsum(dO * O) - dlse`` (the ``- dlse`` term carries gradients of the lse
output), then ``dV = P^T dO``, ``dK = scale * dS^T Q``, ``dQ = scale * dS K``.

Three launches, no atomics (so results are bitwise reproducible): ``delta_kernel`` (one
pass over ``O`` and ``dO``), ``dkdv_kernel`` (one program per key block of one K/V head;
it loops over the query heads of its group, so K/V are never repeated and dK/dV come out
summed over the group) and ``dq_kernel`` (one program per query block). Both main
kernels walk the tiles of the block form on their own grid, as the forward does
(``_triton_masks``): the dK/dV pass reads the transposed table rows, the dQ pass the
direct ones; without a table (band and lengths alone) both split the tiles the band
reaches into masked edges and a mask-free middle. Fully masked rows have ``lse = -inf``;
it is read as ``+inf`` so their probabilities, and hence their gradients, are exactly 0.
Keys or values that are not finite and that a visited tile may hide are zeroed before
the kernels; with a table their NaN (``Bad``) joins the scores of the rows that attend
them, without one those rows get a NaN lse, so their gradients are NaN, as the chain
rule makes them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_distance import distance_row, distance_tile
from ._triton_dropout import kept, row_key
from ._triton_kernel import LOG2E
from ._triton_masks import (
    add_poison,
    bias_tile,
    table_row,
    tile_keep,
    tile_slot,
    tile_span,
    tile_start,
)
from ._triton_walk import query_tiles, valid_lengths

__all__ = ["delta_kernel", "dkdv_kernel", "scores_of_tile"]

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def delta_kernel(Out, DO, Lse, DLse, Delta,
                 stride_oz, stride_oh, stride_om, stride_od,
                 stride_doz, stride_doh, stride_dom, stride_dod,
                 num_heads, q_len, value_head_dim,
                 BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr):
    """Grid ``(Z * num_heads, cdiv(q_len, BLOCK_M))``: ``Delta = rowsum(dO * O) - dlse``,
    0 on fully masked rows (whatever dO and dlse hold there)."""
    pid_zh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    off_z = (pid_zh // num_heads).to(tl.int64)
    off_h = (pid_zh % num_heads).to(tl.int64)
    in_q = rows < q_len
    inside = in_q[:, None] & (offs_dv[None, :] < value_head_dim)
    o = tl.load(Out + off_z * stride_oz + off_h * stride_oh + rows[:, None] * stride_om
                + offs_dv[None, :] * stride_od, mask=inside, other=0.0)
    do = tl.load(DO + off_z * stride_doz + off_h * stride_doh + rows[:, None] * stride_dom
                 + offs_dv[None, :] * stride_dod, mask=inside, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_ptrs = pid_zh.to(tl.int64) * q_len + rows
    if HAS_DLSE:
        delta -= tl.load(DLse + row_ptrs, mask=in_q, other=0.0)
    lse = tl.load(Lse + row_ptrs, mask=in_q, other=NEG_INF)
    tl.store(Delta + row_ptrs, tl.where(lse == NEG_INF, 0.0, delta), mask=in_q)


@triton.jit
def _scores(qk, sm_scale, softcap, SOFTCAP: tl.constexpr):
    """Scores in base 2, as the forward computes them, and ``tanh`` (softcap only)."""
    if SOFTCAP:
        x = qk * (sm_scale / softcap)
        t = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
        return t * (softcap * LOG2E), t
    return qk * (sm_scale * LOG2E), qk


@triton.jit
def _row_stats(Lse, Delta, rows, q_len, MASKED: tl.constexpr):
    """lse in base 2 (+inf where no key is allowed: P = 0 there) and Delta per row."""
    if MASKED:
        lse = tl.load(Lse + rows, mask=rows < q_len, other=NEG_INF)
        delta = tl.load(Delta + rows, mask=rows < q_len, other=0.0)
    else:
        lse = tl.load(Lse + rows)
        delta = tl.load(Delta + rows)
    lse = tl.where(lse == NEG_INF, float("inf"), lse * LOG2E)
    return lse, delta


@triton.jit
def _load_tile(ptrs, n_idx, n_len, d_idx, d_len, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a tile indexed by ``n_idx`` (sequence) and ``d_idx`` (head dim), broadcast
    against each other; bounds are checked only where they can be crossed."""
    if MASKED:
        if EVEN_D:
            return tl.load(ptrs, mask=n_idx < n_len, other=0.0)
        return tl.load(ptrs, mask=(n_idx < n_len) & (d_idx < d_len), other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=d_idx < d_len, other=0.0)


@triton.jit
def scores_of_tile(qk, bias, Distance, bad, rows, cols, kv_valid, lower_off, upper_off, Bits,
                   slot, sm_scale, softcap, MASKED: tl.constexpr, HAS_LOWER: tl.constexpr,
                   HAS_UPPER: tl.constexpr, HAS_BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_DISTANCE: tl.constexpr, HAS_BAD: tl.constexpr, SOFTCAP: tl.constexpr,
                   TILE_Q: tl.constexpr, TILE_K: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Scores in base 2 as the forward computes them (softcap, bias, a score change by
    distance, mask: ``rows`` and ``cols`` broadcast to the tile, see ``tile_keep``),
    plus the ``bad`` keys' NaN where the row attends them; and ``tanh`` (softcap
    only). ``TRANSPOSED`` tiles are the dK/dV pass's (its entries read in halves, see
    ``distance_tile``)."""
    s, t = _scores(qk, sm_scale, softcap, SOFTCAP)
    if HAS_BIAS:
        s += bias * LOG2E
    if HAS_DISTANCE:  # loaded after the product, so that it is not live across it
        s += distance_tile(Distance, rows, cols, TRANSPOSED) * LOG2E
    if HAS_BAD:
        s = add_poison(s, bad, HAS_BIAS)
    if MASKED:
        keep = tile_keep(rows, cols, kv_valid, lower_off, upper_off, Bits, slot, HAS_LOWER,
                         HAS_UPPER, HAS_BITS, TILE_Q, TILE_K, TRANSPOSED)
        s = tl.where(keep, s, NEG_INF)
    return s, t


@triton.jit
def _dkdv_tiles(dk, dv, k, v, bad, Q, DO, Lse, Delta, Bits, Bias, Distance, tiles, lo, hi,
                num_cols,
                offs_n, offs_d, offs_dv, stride_qm, stride_qd, stride_dom, stride_dod,
                stride_bm, stride_bn, q_len, kv_len, kv_valid, head_dim, value_head_dim,
                sm_scale, softcap, lower_off, upper_off, drop_key, drop_threshold, drop_scale,
                MASKED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
                HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr, HAS_BAD: tl.constexpr,
                HAS_BITS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DISTANCE: tl.constexpr,
                HAS_TABLE: tl.constexpr, SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                DROPOUT: tl.constexpr):
    """Add the query blocks of ``range(lo, hi, BLOCK_M)`` (see ``tile_span``; of one
    head) to this key block's dK and dV. With ``DROPOUT``, ``Z`` the kept pairs over
    ``1 - p``: ``dV += (P Z)^T dO`` and ``dS = P (dP Z - Delta)``."""
    offs_m = tl.arange(0, BLOCK_M)
    for pos in range(lo, hi, BLOCK_M):
        start_m = tile_start(tiles, pos, BLOCK_M, HAS_TABLE)
        rows = start_m + offs_m
        qT = _load_tile(Q + rows[None, :] * stride_qm + offs_d[:, None] * stride_qd,
                        rows[None, :], q_len, offs_d[:, None], head_dim, MASKED, EVEN_D)
        do = _load_tile(DO + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                        rows[:, None], q_len, offs_dv[None, :], value_head_dim, MASKED,
                        EVEN_D)
        lse, delta = _row_stats(Lse, Delta, rows, q_len, MASKED)
        slot = 0
        bias = 0.0
        if MASKED and HAS_BITS:
            slot = tile_slot(tiles, num_cols, pos, BLOCK_M)
        if HAS_BIAS:
            bias = bias_tile(Bias, rows[None, :], offs_n[:, None], q_len, kv_len, stride_bm,
                             stride_bn)
        sT, tT = scores_of_tile(tl.dot(k, qT, input_precision=INPUT_PRECISION), bias,
                                Distance, bad, rows[None, :], offs_n[:, None], kv_valid,
                                lower_off, upper_off, Bits, slot, sm_scale, softcap, MASKED,
                                HAS_LOWER, HAS_UPPER, HAS_BITS, HAS_BIAS, HAS_DISTANCE,
                                HAS_BAD, SOFTCAP, BLOCK_M, BLOCK_N, True)
        pT = tl.math.exp2(sT - lse[None, :])
        if DROPOUT:
            dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
            keepT = kept(drop_key, rows[None, :], offs_n[:, None], drop_threshold)
            dv = tl.dot(tl.where(keepT, pT * drop_scale, 0.0).to(do.dtype), do, dv,
                        input_precision=INPUT_PRECISION)
            dpT = tl.where(keepT, dpT * drop_scale, 0.0)
        else:  # dV first: the order the register budget of the table's tiles is set for
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
            dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:  # d(c tanh(x / c)) / dx = 1 - tanh^2
            dsT = dsT * (1.0 - tT * tT)
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def dkdv_kernel(
        Q, K, V, DO, Lse, Delta, DK, DV, KeyLengths, QueryLengths, Bad, Table, Bits, Bias,
        Distance, stride_qz, stride_qh, stride_qm, stride_qd,
        stride_kz, stride_kh, stride_kn, stride_kd,
        stride_vz, stride_vh, stride_vn, stride_vd,
        stride_doz, stride_doh, stride_dom, stride_dod,
        stride_dkz, stride_dkh, stride_dkn, stride_dkd,
        stride_dvz, stride_dvh, stride_dvn, stride_dvd,
        stride_bz, stride_bh, stride_bm, stride_bn,
        table_z, table_h, table_n, num_cols,
        num_kv_heads, group_size, q_len, kv_len, head_dim, value_head_dim,
        sm_scale, softcap, lower_off, upper_off, Word, drop_threshold, drop_scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_LOWER: tl.constexpr,
        HAS_UPPER: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
        HAS_QUERY_LENGTHS: tl.constexpr, HAS_BAD: tl.constexpr, HAS_BITS: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_DISTANCE: tl.constexpr, HAS_TABLE: tl.constexpr,
        SOFTCAP: tl.constexpr, REVERSE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        DROPOUT: tl.constexpr):
    """Grid ``(Z * num_kv_heads, cdiv(kv_len, BLOCK_N))``; writes ``DK`` and ``DV``.
    ``Table`` holds the block form's rows per key block (the transposed lists);
    ``Distance`` a score change by distance, as the forward reads it."""
    pid_zh = tl.program_id(0)
    pid_n = tl.program_id(1)
    if REVERSE:  # bands open to the right: the last key blocks see the most queries
        pid_n = tl.num_programs(1) - 1 - pid_n
    off_z = (pid_zh // num_kv_heads).to(tl.int64)
    off_kvh = (pid_zh % num_kv_heads).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    kv_valid, q_valid = valid_lengths(KeyLengths, QueryLengths, off_z, q_len, kv_len,
                                      HAS_KEY_LENGTHS, HAS_QUERY_LENGTHS)
    t_lo = 0
    u_lo = 0
    u_hi = 0
    t_hi = 0
    if not HAS_TABLE:
        t_lo, u_lo, u_hi, t_hi = query_tiles(n0, q_valid, kv_valid, lower_off, upper_off,
                                             BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER)

    in_k = offs_n < kv_len
    k = _load_tile(K + off_z * stride_kz + off_kvh * stride_kh + offs_n[:, None] * stride_kn
                   + offs_d[None, :] * stride_kd, offs_n[:, None], kv_len, offs_d[None, :],
                   head_dim, True, EVEN_D)
    v = _load_tile(V + off_z * stride_vz + off_kvh * stride_vh + offs_n[:, None] * stride_vn
                   + offs_dv[None, :] * stride_vd, offs_n[:, None], kv_len, offs_dv[None, :],
                   value_head_dim, True, EVEN_D)
    bad = 0.0
    if HAS_BAD:
        bad = tl.load(Bad + pid_zh.to(tl.int64) * kv_len + offs_n, mask=in_k,
                      other=0.0)[:, None]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    for g in range(group_size):  # the query heads sharing this K/V head
        off_h = off_kvh * group_size + g
        Qh = Q + off_z * stride_qz + off_h * stride_qh
        DOh = DO + off_z * stride_doz + off_h * stride_doh
        Biash = Bias + off_z * stride_bz + off_h * stride_bh
        Distanceh = Distance
        if HAS_DISTANCE:  # at the head's entry of j == i
            Distanceh = distance_row(Distance, off_h, q_len, kv_len)
        row0 = (off_z * num_kv_heads * group_size + off_h) * q_len
        drop_key = 0
        if DROPOUT:
            drop_key = row_key(Word, off_z * num_kv_heads * group_size + off_h)
        row = Table
        if HAS_TABLE:
            row = table_row(Table, off_z, off_h, pid_n, table_z, table_h, table_n)
        for part in tl.static_range(3):  # masked head, mask-free middle, masked tail
            if not (HAS_TABLE and part == 0):  # a table lists no head
                tiles, lo, hi = tile_span(row, num_cols, part, t_lo, u_lo, u_hi, t_hi,
                                          BLOCK_M, HAS_TABLE)
                dk, dv = _dkdv_tiles(
                    dk, dv, k, v, bad, Qh, DOh, Lse + row0, Delta + row0, Bits, Biash,
                    Distanceh, tiles, lo, hi, num_cols, offs_n, offs_d, offs_dv, stride_qm,
                    stride_qd, stride_dom, stride_dod, stride_bm, stride_bn, q_len, kv_len,
                    kv_valid, head_dim, value_head_dim, sm_scale, softcap, lower_off,
                    upper_off, drop_key, drop_threshold, drop_scale, part != 1, BLOCK_M,
                    BLOCK_N, EVEN_D, HAS_LOWER, HAS_UPPER, HAS_BAD, HAS_BITS, HAS_BIAS,
                    HAS_DISTANCE, HAS_TABLE, SOFTCAP, INPUT_PRECISION, DROPOUT)

    dk_ptrs = (DK + off_z * stride_dkz + off_kvh * stride_dkh + offs_n[:, None] * stride_dkn
               + offs_d[None, :] * stride_dkd)
    dv_ptrs = (DV + off_z * stride_dvz + off_kvh * stride_dvh + offs_n[:, None] * stride_dvn
               + offs_dv[None, :] * stride_dvd)
    dk = (dk * sm_scale).to(DK.dtype.element_ty)
    dv = dv.to(DV.dtype.element_ty)
    if EVEN_D:
        tl.store(dk_ptrs, dk, mask=in_k[:, None])
        tl.store(dv_ptrs, dv, mask=in_k[:, None])
    else:
        tl.store(dk_ptrs, dk, mask=in_k[:, None] & (offs_d[None, :] < head_dim))
        tl.store(dv_ptrs, dv, mask=in_k[:, None] & (offs_dv[None, :] < value_head_dim))
