"""The fused flash-attention forward kernel, written in Triton.

One program computes one block of ``BLOCK_M`` queries of one (batch, head) pair. It
walks key blocks with an online softmax in base 2 (running max ``m``, running sum
``l``, rescaled accumulator), so memory stays O(L) and scores never leave registers.

Which key blocks it walks comes from the mask's block form, as a table row per query
block (see ``_triton_masks``): the full tiles without any mask or bounds check, then
the partial ones, masked by the band and length formulas and their bit tiles. Masks
the formulas cover alone (a band on ``j - i`` and lengths) need no table: the kernel
derives per query block the key blocks that hold any allowed pair and those that hold
only allowed pairs from the band (:func:`key_tiles`). Hidden tiles are never visited.

Importing this module imports Triton; set ``TRITON_INTERPRET=1`` before that to run
the kernel on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_distance import distance_row, distance_tile
from ._triton_dropout import kept, row_key
from ._triton_masks import (
    add_poison,
    bias_tile,
    tile_keep,
    tile_slot,
    tile_span,
    tile_start,
)
from ._triton_walk import key_walk

__all__ = ["block_order", "finish_rows", "flash_forward_kernel", "fold_tile",
           "keys_and_values"]

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def fold_tile(acc, l_i, m_i, q, k, v, rows, cols, kv_valid, lower_off, upper_off, Bits, slot,
              bias, Distance, poison, sm_scale, softcap, drop_key, drop_threshold, drop_scale,
              MASKED: tl.constexpr, HAS_LOWER: tl.constexpr,
              HAS_UPPER: tl.constexpr, HAS_BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_DISTANCE: tl.constexpr, POISON_SCORES: tl.constexpr, SOFTCAP: tl.constexpr,
              INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              DROPOUT: tl.constexpr):
    """One step of the online softmax: scores of ``q`` against the key tile ``k``
    (``[BLOCK_D, BLOCK_N]``), plus the ``bias`` tile (float32) and a score change by
    distance (``_triton_distance``: loaded after the product, so that it is not live
    across it), folded with ``v`` into the running ``(acc, l_i, m_i)``. ``MASKED``
    tiles keep the pairs of query ``rows`` and key ``cols`` that ``tile_keep`` allows
    (band, key length, bit tile ``slot``). Their poisoned keys (``Poison``: a value that
    is not finite; the value is loaded as 0) must score NaN in every row that attends
    them, so that exactly those rows come out NaN: the pointer paths load such keys as
    NaN, and with ``POISON_SCORES`` the ``poison`` (NaN there, else 0) is added to the
    scores here. With ``DROPOUT`` the weights that reach ``v`` are dropped
    (``_triton_dropout``: the row hashed to ``drop_key``), after the running sum took
    them whole. Shared by every forward path."""
    qk = tl.dot(q, k, input_precision=INPUT_PRECISION)
    if SOFTCAP:
        # softcap * tanh(x), tanh through exp2 (saturates cleanly to +-1)
        x = qk * (sm_scale / softcap)
        s = (1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)) * (softcap * LOG2E)
    else:
        s = qk * (sm_scale * LOG2E)
    if HAS_BIAS:  # after the softcap, before the mask
        s += bias * LOG2E
    if HAS_DISTANCE:  # beside the bias
        s += distance_tile(Distance, rows[:, None], cols[None, :], False) * LOG2E
    if MASKED:
        if POISON_SCORES:
            s = add_poison(s, poison[None, :], HAS_BIAS)
        keep = tile_keep(rows[:, None], cols[None, :], kv_valid, lower_off, upper_off, Bits,
                         slot, HAS_LOWER, HAS_UPPER, HAS_BITS, BLOCK_M, BLOCK_N, False)
        s = tl.where(keep, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing allowed so far keeps m = -inf; shift by 0 instead so
    # exp2 sees -inf - 0 (= 0) rather than -inf - -inf (= nan).
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DROPOUT:
        p = tl.where(kept(drop_key, rows[:, None], cols[None, :], drop_threshold),
                     p * drop_scale, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def finish_rows(acc, l_i, m_i, offs_m, q_valid):
    """``(out, lse)`` of the running state; rows with no allowed key (or query
    padding) give 0 and -inf. A row whose sum is NaN (a NaN query, or scores that
    overflow to +inf) stays NaN."""
    has_mass = ((l_i > 0.0) | (l_i != l_i)) & (offs_m < q_valid)
    l_safe = tl.where(has_mass, l_i, 1.0)
    out = acc / l_safe[:, None]
    out = tl.where(has_mass[:, None], out, 0.0)
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has_mass, (m_fin + tl.math.log2(l_safe)) / LOG2E, float("-inf"))
    return out, lse


@triton.jit
def block_order(num_heads, q_len, BLOCK_M: tl.constexpr, REVERSE: tl.constexpr):
    """``(pid_zh, pid_m)`` of this program in a one-dimensional grid whose consecutive
    programs are query blocks of one (batch, head): they read the same K/V, which then
    stays in L2 across them. ``REVERSE`` (causal-like bands) starts each head's last
    query blocks, which do the most work, first."""
    pid = tl.program_id(0)
    num_m_blocks = tl.cdiv(q_len, BLOCK_M)
    pid_zh = pid // num_m_blocks
    pid_m = pid % num_m_blocks
    if REVERSE:
        pid_m = num_m_blocks - 1 - pid_m
    return pid_zh, pid_m


@triton.jit
def keys_and_values(K, V, Poison, cols, offs_d, offs_dv, stride_kn, stride_kd, stride_vn,
                    stride_vd, kv_valid, head_dim, value_head_dim, MASKED: tl.constexpr,
                    EVEN_D: tl.constexpr, HAS_POISON: tl.constexpr,
                    POISON_SCORES: tl.constexpr):
    """``(k, v, poison)``: the key tile transposed ``(BLOCK_D, BLOCK_N)`` and the value
    tile ``(BLOCK_N, BLOCK_DV)`` at keys ``cols``, and their poison (0.0 unless
    ``MASKED`` with ``HAS_POISON``). Full tiles are read whole; a masked tile never
    reads keys past ``kv_valid`` nor poisoned values (they load as 0), and loads a
    poisoned key as its poison (NaN), unless ``POISON_SCORES`` adds it to the scores
    instead (see :func:`fold_tile`)."""
    k_ptrs = K + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd
    v_ptrs = V + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    poison = 0.0
    if MASKED:
        in_k = cols < kv_valid
        k_other = 0.0
        if HAS_POISON:
            poison = tl.load(Poison + cols, mask=in_k, other=0.0)
            if not POISON_SCORES:
                k_other = poison[None, :]
            in_k &= poison == 0.0
        if EVEN_D:
            k = tl.load(k_ptrs, mask=in_k[None, :], other=k_other)
            v = tl.load(v_ptrs, mask=in_k[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=in_k[None, :] & (offs_d[:, None] < head_dim),
                        other=k_other)
            v = tl.load(v_ptrs, mask=in_k[:, None] & (offs_dv[None, :] < value_head_dim),
                        other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_d[:, None] < head_dim, other=0.0)
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < value_head_dim, other=0.0)
    return k, v, poison


@triton.jit
def _attend(acc, l_i, m_i, q, K, V, Poison, Bits, Bias, Distance, tiles, lo, hi, num_cols,
            offs_m,
            offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_bm,
            stride_bn, q_len, kv_len, kv_valid, head_dim, value_head_dim, sm_scale,
            softcap, lower_off, upper_off, drop_key, drop_threshold, drop_scale,
            MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, HAS_LOWER: tl.constexpr,
            HAS_UPPER: tl.constexpr, HAS_POISON: tl.constexpr, HAS_BITS: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_DISTANCE: tl.constexpr, HAS_TABLE: tl.constexpr,
            POISON_SCORES: tl.constexpr, SOFTCAP: tl.constexpr,
            INPUT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    """Fold the key blocks of ``range(lo, hi, BLOCK_N)`` (see ``tile_span``) into the
    running state, loading through pointers. ``MASKED`` (partial) tiles may hold
    disallowed pairs or keys past the end; full tiles are read whole. Keys past the
    key length are never read, nor poisoned values: their weight may be 0, but a NaN
    would still reach ``P @ V`` as ``0 * NaN``. Masked tiles load poisoned keys as NaN,
    or, with ``POISON_SCORES``, add the poison to the scores instead (the form ptxas
    fits in registers for float32 tiles, and the one that lets a bias hide a key)."""
    offs_n = tl.arange(0, BLOCK_N)
    for pos in range(lo, hi, BLOCK_N):
        start_n = tile_start(tiles, pos, BLOCK_N, HAS_TABLE)
        cols = start_n + offs_n
        k, v, poison = keys_and_values(K, V, Poison, cols, offs_d, offs_dv, stride_kn,
                                       stride_kd, stride_vn, stride_vd, kv_valid, head_dim,
                                       value_head_dim, MASKED, EVEN_D, HAS_POISON,
                                       POISON_SCORES)
        slot = 0
        bias = 0.0
        if MASKED and HAS_BITS:
            slot = tile_slot(tiles, num_cols, pos, BLOCK_N)
        if HAS_BIAS:
            bias = bias_tile(Bias, offs_m[:, None], cols[None, :], q_len, kv_len, stride_bm,
                             stride_bn)
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, q, k, v, offs_m, cols, kv_valid, lower_off,
                                  upper_off, Bits, slot, bias, Distance, poison, sm_scale,
                                  softcap, drop_key, drop_threshold, drop_scale, MASKED,
                                  HAS_LOWER, HAS_UPPER, HAS_BITS, HAS_BIAS, HAS_DISTANCE,
                                  POISON_SCORES, SOFTCAP, INPUT_PRECISION, BLOCK_M, BLOCK_N,
                                  DROPOUT)
    return acc, l_i, m_i


@triton.jit
def flash_forward_kernel(
        Q, K, V, Out, Lse, KeyLengths, QueryLengths, Poison, Table, Bits, Bias, Distance,
        stride_qz, stride_qh, stride_qm, stride_qd,
        stride_kz, stride_kh, stride_kn, stride_kd,
        stride_vz, stride_vh, stride_vn, stride_vd,
        stride_oz, stride_oh, stride_om, stride_od,
        stride_bz, stride_bh, stride_bm, stride_bn,
        table_z, table_h, table_m, num_cols,
        num_heads, group_size, q_len, kv_len, head_dim, value_head_dim,
        sm_scale, softcap, lower_off, upper_off, Word, drop_threshold, drop_scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_LOWER: tl.constexpr,
        HAS_UPPER: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
        HAS_QUERY_LENGTHS: tl.constexpr, HAS_POISON: tl.constexpr, HAS_BITS: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_DISTANCE: tl.constexpr, HAS_TABLE: tl.constexpr,
        SOFTCAP: tl.constexpr, REVERSE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        DROPOUT: tl.constexpr):
    """Grid ``(Z * num_heads, cdiv(q_len, BLOCK_M))``; writes ``Out`` and ``Lse``.
    ``Poison`` is ``(Z, Hkv, kv_len)`` float32 (see :func:`fold_tile`); ``Table`` the
    block form's rows per query block (``_triton_masks``; read with ``HAS_TABLE``),
    ``Bits`` its bit tiles,
    ``Bias`` read with its strides (0 along broadcast axes), ``Distance`` the score
    change by distance, ``(num_heads, q_len + kv_len - 1)`` float32 (read with
    ``HAS_DISTANCE``; see ``_triton_distance``). (The tensor-descriptor
    kernel orders its grid for L2 with :func:`block_order`; here the index arithmetic
    would cost sm_80 tiles their last free registers.) ``Word`` is dropout's seed word
    (read with ``DROPOUT``)."""
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
    kv_valid, q_valid, row, t_lo, u_lo, u_hi, t_hi = key_walk(
        Table, KeyLengths, QueryLengths, off_z, off_h, pid_m, m0, q_len, kv_len, table_z,
        table_h, table_m, lower_off, upper_off, BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER,
        HAS_KEY_LENGTHS, HAS_QUERY_LENGTHS, HAS_TABLE)

    q_ptrs = (Q + off_z * stride_qz + off_h * stride_qh
              + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    if EVEN_D:
        q = tl.load(q_ptrs, mask=offs_m[:, None] < q_len, other=0.0)
    else:
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim),
                    other=0.0)
    K += off_z * stride_kz + off_kvh * stride_kh
    V += off_z * stride_vz + off_kvh * stride_vh
    Poison += (off_z * (num_heads // group_size) + off_kvh) * kv_len
    Bias += off_z * stride_bz + off_h * stride_bh
    if HAS_DISTANCE:  # at the head's entry of j == i
        Distance = distance_row(Distance, off_h, q_len, kv_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    drop_key = 0
    if DROPOUT:
        drop_key = row_key(Word, pid_zh)

    for part in tl.static_range(3):  # masked head, mask-free middle, masked tail
        if not (HAS_TABLE and part == 0):  # a table lists no head
            tiles, lo, hi = tile_span(row, num_cols, part, t_lo, u_lo, u_hi, t_hi, BLOCK_N,
                                      HAS_TABLE)
            acc, l_i, m_i = _attend(
                acc, l_i, m_i, q, K, V, Poison, Bits, Bias, Distance, tiles, lo, hi, num_cols,
                offs_m, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_bm,
                stride_bn, q_len, kv_len, kv_valid, head_dim, value_head_dim, sm_scale,
                softcap, lower_off, upper_off, drop_key, drop_threshold, drop_scale,
                part != 1, BLOCK_M, BLOCK_N, EVEN_D, HAS_LOWER,
                HAS_UPPER, HAS_POISON, HAS_BITS, HAS_BIAS, HAS_DISTANCE, HAS_TABLE,
                HAS_POISON and (HAS_BIAS or Q.dtype.element_ty == tl.float32), SOFTCAP,
                INPUT_PRECISION, DROPOUT)

    out, lse = finish_rows(acc, l_i, m_i, offs_m, q_valid)

    in_q = offs_m < q_len
    tl.store(Lse + pid_zh.to(tl.int64) * q_len + offs_m, lse, mask=in_q)
    o_ptrs = (Out + off_z * stride_oz + off_h * stride_oh
              + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od)
    if EVEN_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=in_q[:, None])
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty),
                 mask=in_q[:, None] & (offs_dv[None, :] < value_head_dim))
