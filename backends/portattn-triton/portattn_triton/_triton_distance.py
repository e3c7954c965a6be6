"""A score change by distance in the Triton kernels (see ``_distance``).

The change arrives as one float32 row per query head, ``(Hq, Lq + Lk - 1)``, the
entry of query ``i`` and key ``j`` at ``j - i + Lq - 1``, padded with ``PAD`` zeros on
both sides. A kernel points ``Distance`` at its head's entry for ``j == i``
(:func:`distance_row`) and loads a tile's entries at ``j - i`` from there
(:func:`distance_tile`), with no mask: the padding holds every tile of the grid. A tile
touches ``BLOCK_M + BLOCK_N - 1`` entries, which the cache serves. The dQ pass sums
each tile's score gradient along its diagonals (:func:`store_diagonal_sums`) into
slices of a buffer that only its program writes: no atomics, so the launcher's
fixed-order sum of the slices is the same on every run. Importing this module imports
Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _distance

__all__ = ["distance_row", "distance_rows", "distance_slot", "distance_tile",
           "store_diagonal_sums"]

PAD: tl.constexpr = tl.constexpr(_distance.PAD)


@triton.jit
def distance_row(Distance, head, q_len, kv_len):
    """``Distance`` moved to the entry of ``j == i`` of query head ``head`` (int64; a
    ``[BLOCK_M, 1]`` column of heads gives a column of pointers)."""
    return Distance + head * (q_len + kv_len - 1 + 2 * PAD) + (PAD + q_len - 1)


@triton.jit
def distance_tile(Distance, rows, cols, HALVES: tl.constexpr):
    """The change's entries at query ``rows`` and key ``cols`` of the grid (broadcast
    against each other), float32; ``Distance`` from :func:`distance_row`. Pairs past
    the call read the padding or a neighbour's entry: the mask hides them.

    ``HALVES`` reads each entry as two 16-bit halves, put back together exactly:
    Triton's pipeliner prefetches the loads of 32 bits or more that feed a product,
    and in the dK/dV pass these (one unaligned entry per pair) would each hold an
    address for iterations ahead, more registers than it has; the other kernels fit
    them prefetched, and two loads per entry would cost them more."""
    if HALVES:
        halves = Distance.to(tl.pointer_type(tl.int16)) + 2 * (cols - rows)
        low = tl.load(halves).to(tl.int32) & 0xFFFF  # little-endian: the low half first
        high = tl.load(halves + 1).to(tl.int32)
        return ((high << 16) | low).to(tl.float32, bitcast=True)
    return tl.load(Distance + (cols - rows))


@triton.jit
def _slices(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Slices per program: a tile's diagonals span ``BLOCK_M + BLOCK_N - 1`` entries,
    so tiles this many key blocks apart never share one."""
    return (BLOCK_M + BLOCK_N - 2) // BLOCK_N + 1


@triton.jit
def _width(kv_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Entries per slice: the diagonals one block of queries meets."""
    return tl.cdiv(kv_len, BLOCK_N) * BLOCK_N + BLOCK_M - 1


@triton.jit
def distance_rows(DDistance, pid_zh, pid_m, kv_len, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The slices of the query block ``pid_m`` of ``pid_zh`` in the gradient buffer
    (``_distance.gradient_buffer``)."""
    program = pid_zh.to(tl.int64) * tl.num_programs(1) + pid_m
    return DDistance + program * (_slices(BLOCK_M, BLOCK_N) * _width(kv_len, BLOCK_M, BLOCK_N))


@triton.jit
def distance_slot(Rows, start_n, kv_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The slice that the tile of keys from ``start_n`` writes its diagonal sums to."""
    slot = (start_n // BLOCK_N) % _slices(BLOCK_M, BLOCK_N)
    return Rows + slot * _width(kv_len, BLOCK_M, BLOCK_N)


@triton.jit
def _rotated_sums(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``(near, far)``, ``[ROWS]`` each, for ``x`` ``[ROWS, COLS]`` with ``ROWS >=
    COLS``: the sums of ``x`` along its diagonals ``c - r = -y`` (``near[y]``) and
    ``c - r = ROWS - y`` (``far[y]``, 0 for ``y <= ROWS - COLS``). Column ``c`` is
    rotated up by ``c`` (a gather in registers), which puts every diagonal in one row,
    the two that share a row told apart by whether they wrapped."""
    y = tl.arange(0, ROWS)[:, None]
    source = y + tl.arange(0, COLS)[None, :]
    wraps = source >= ROWS
    rotated = tl.gather(x, tl.where(wraps, source - ROWS, source), 0)
    near = tl.sum(tl.where(wraps, 0.0, rotated), 1)
    far = tl.sum(tl.where(wraps, rotated, 0.0), 1)
    return near, far


@triton.jit
def store_diagonal_sums(Slot, ds, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write the sums of ``ds`` ``[BLOCK_M, BLOCK_N]`` (a query block by the keys from
    ``start_n``) along its diagonals to ``Slot``: the sum of ``j - i = d`` (``i``
    counted from the block's first query) at ``start_n + d + BLOCK_M - 1``."""
    Diagonal0 = Slot + start_n + BLOCK_M - 1
    if BLOCK_M >= BLOCK_N:
        near, far = _rotated_sums(ds, BLOCK_M, BLOCK_N)
        y = tl.arange(0, BLOCK_M)
        tl.store(Diagonal0 - y, near)
        tl.store(Diagonal0 + BLOCK_M - y, far, mask=y > BLOCK_M - BLOCK_N)
    else:  # rotate the keys instead: transposed, i - j = -y is j - i = y
        near, far = _rotated_sums(tl.trans(ds), BLOCK_N, BLOCK_M)
        y = tl.arange(0, BLOCK_N)
        tl.store(Diagonal0 + y, near)
        tl.store(Diagonal0 + y - BLOCK_N, far, mask=y > BLOCK_N - BLOCK_M)
