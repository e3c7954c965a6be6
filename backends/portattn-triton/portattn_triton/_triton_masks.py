"""How every Triton kernel reads a mask and a bias (see ``_plan`` and ``_tables``).

A program reads one table row: ``[n_partial, n_full, partial[C], slot[C], full[C]]``.
Full tiles run with no mask; a partial tile keeps the pairs allowed by the band on
``j - i`` (``lower_off <= j - i <= upper_off``), by the key length and, when its slot
is not -1, by its bit tile. Masks the formulas cover on their own (band and lengths),
with no bias, need no table (``HAS_TABLE`` off): the kernels then derive the tiles
from the band, as a contiguous masked head, mask-free middle and masked tail, so
their loops load nothing but the tiles. Importing this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["add_poison", "band_keep", "bias_tile", "bit_keep", "table_row", "tile_keep",
           "tile_slot", "tile_span", "tile_start"]


@triton.jit
def table_row(Table, off_z, off_h, block, table_z, table_h, table_row_stride):
    """Pointer to the row of batch element ``off_z``, head ``off_h`` and ``block``."""
    return (Table + off_z.to(tl.int64) * table_z + off_h.to(tl.int64) * table_h
            + block.to(tl.int64) * table_row_stride)


@triton.jit
def tile_span(row, num_cols, part: tl.constexpr, t_lo, u_lo, u_hi, t_hi,
              BLOCK: tl.constexpr, HAS_TABLE: tl.constexpr):
    """``(tiles, lo, hi)``: part ``part`` of a block's tiles (0: masked head, 1: the
    mask-free middle, 2: masked tail), walked as ``range(lo, hi, BLOCK)``. Without a
    table, the bounds from the band (``t_lo <= u_lo <= u_hi <= t_hi``, multiples of
    ``BLOCK``) and positions are tile starts; with one, the middle is the row's full
    tiles, the tail its partial ones and the head is empty, and a position indexes
    ``tiles`` (see :func:`tile_start`)."""
    tiles = row
    if HAS_TABLE:
        lo = 0
        if part == 1:
            tiles = row + 2 + 2 * num_cols
            hi = tl.load(row + 1) * BLOCK
        elif part == 2:
            tiles = row + 2
            hi = tl.load(row) * BLOCK
        else:
            hi = 0
    else:
        if part == 0:
            lo = t_lo
            hi = u_lo
        elif part == 1:
            lo = u_lo
            hi = u_hi
        else:
            lo = u_hi
            hi = t_hi
    return tiles, lo, hi


@triton.jit
def tile_start(tiles, pos, BLOCK: tl.constexpr, HAS_TABLE: tl.constexpr):
    """The first index of the tile at loop position ``pos`` (see :func:`tile_span`)."""
    if HAS_TABLE:  # noqa: SIM108 (an expression would trace both)
        start = tl.load(tiles + pos // BLOCK) * BLOCK
    else:
        start = pos
    return tl.multiple_of(start, BLOCK)


@triton.jit
def tile_slot(tiles, num_cols, pos, BLOCK: tl.constexpr):
    """The bit tile slot of the partial tile at loop position ``pos`` (a table's)."""
    return tl.load(tiles + num_cols + pos // BLOCK)


@triton.jit
def band_keep(rows, cols, kv_valid, lower_off, upper_off, HAS_LOWER: tl.constexpr,
              HAS_UPPER: tl.constexpr):
    """Pairs of ``rows`` and ``cols`` (broadcast against each other) inside the band
    and before the key length."""
    keep = cols < kv_valid
    if HAS_LOWER:
        keep &= (cols - rows) >= lower_off
    if HAS_UPPER:
        keep &= (cols - rows) <= upper_off
    return keep


@triton.jit
def bit_keep(Bits, slot, TILE_Q: tl.constexpr, TILE_K: tl.constexpr):
    """The bit tile ``slot`` as ``[TILE_Q, TILE_K]`` booleans; every pair where ``slot``
    is -1. Loaded as bytes (eight keys each) and unpacked in registers: a load per pair
    would cost each thread a pointer per pair."""
    base = Bits + tl.maximum(slot, 0).to(tl.int64) * (TILE_Q * (TILE_K // 8))
    offs = tl.arange(0, TILE_Q)[:, None] * (TILE_K // 8) + tl.arange(0, TILE_K // 8)[None, :]
    packed = tl.load(base + offs, mask=slot >= 0, other=255).to(tl.int32)
    bits = (packed[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
    return tl.reshape(bits, (TILE_Q, TILE_K)) != 0


@triton.jit
def tile_keep(rows, cols, kv_valid, lower_off, upper_off, Bits, slot, HAS_LOWER: tl.constexpr,
              HAS_UPPER: tl.constexpr, HAS_BITS: tl.constexpr, TILE_Q: tl.constexpr,
              TILE_K: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The pairs a partial tile keeps: :func:`band_keep` and, with ``HAS_BITS``, the bit
    tile ``slot`` (transposed to ``[TILE_K, TILE_Q]`` with ``TRANSPOSED``, for ``rows``
    along the second axis). Called after the tile's product, so that the mask is not
    live across it."""
    keep = band_keep(rows, cols, kv_valid, lower_off, upper_off, HAS_LOWER, HAS_UPPER)
    if HAS_BITS:
        bits = bit_keep(Bits, slot, TILE_Q, TILE_K)
        if TRANSPOSED:
            bits = tl.trans(bits)
        keep &= bits
    return keep


@triton.jit
def bias_tile(Bias, rows, cols, q_len, kv_len, stride_bm, stride_bn):
    """The bias at ``rows`` and ``cols`` (broadcast against each other) in float32, 0
    outside the arrays (``Bias`` already points at the batch element and head)."""
    inside = (rows < q_len) & (cols < kv_len)
    return tl.load(Bias + rows * stride_bm + cols * stride_bn, mask=inside,
                   other=0.0).to(tl.float32)


@triton.jit
def add_poison(s, poison, GUARD: tl.constexpr):
    """Scores ``s`` plus ``poison`` (NaN on the keys whose value is not finite, 0
    elsewhere; broadcast along the rows): every row that attends such a key scores NaN
    on it. With ``GUARD`` (a bias), a score the bias made ``-inf`` stays hidden."""
    if GUARD:
        return tl.where(s == float("-inf"), s, s + poison)
    return s + poison
