"""The fast way's blocks, in one compiled call that holds no GIL (``pip install
portattn-numpy[jit]``); importing this module without Numba raises ``ImportError``.

Per block of keys against a range of a unit's rows: the scores by BLAS, the entries
the block's masks hide set to ``-inf`` (a mask's partial tiles, ``_blocks``), their
``exp2`` and row sums (``_compiled_exp.exp2_row_sums``; with a score change by
distance added in the same pass, ``exp2_shifted_row_sums``), the weights times the
values by BLAS, added into the unit's accumulator by the product itself (``beta =
1``). BLAS is NumPy's own library, called by address (``_cblas``, ``_compiled_blas``).

Unlike the other tiles (``_scores``), these are kept queries by keys: ``q @ k.T``, then
``weights @ v`` with no operand transposed, the shapes OpenBLAS's kernels run closest
to their square-matrix rate.

NumPy's way, a unit makes a few dozen calls, and after each the worker takes the GIL
back, waiting when another worker holds it: the Python between the calls, and the
waiting, grow with the threads. Here a unit's blocks take one call and its last step
another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba import types

from . import _cblas
from ._compiled_blas import NO_TRANS, TRANS, gemm

# Numba's cache checks this file's own date only: a change to the exponential reaches
# the cached loops once this file changes too (or its cache is cleared).
from ._compiled_exp import LOOP_OPTIONS, constants, exp2_row_sums, exp2_shifted_row_sums

__all__ = ["DTYPES", "CompiledBlocks", "compiled_blocks"]

def _compile_accumulate(dtype: Any) -> Any:
    real = numba.from_dtype(np.dtype(dtype))
    matrix = types.Array(real, 2, "A")
    c = constants(dtype, base_e=False)
    size = np.dtype(dtype).itemsize
    table = types.Array(types.int64, 2, "C")
    signature = types.void(types.int64, real, matrix, matrix, matrix, matrix,
                           types.Array(real, 1, "A"), types.Array(real, 1, "C"), types.int64,
                           table, table, types.Array(types.boolean, 1, "C"), types.boolean,
                           types.Array(real, 1, "C", readonly=True), types.int64)

    @numba.njit(signature, **LOOP_OPTIONS)
    def accumulate(address: int, alpha: float, q: Any, k: Any, v: Any, acc: Any, sums: Any,
                   span: Any, stride: int, blocks: Any, masks: Any, hidden: Any,
                   first_writes: bool, shift: Any,
                   origin: int) -> None:  # pragma: no cover - compiled
        d, dv = q.shape[1], v.shape[1]
        one, zero, never = real(1.0), real(0.0), real(-np.inf)
        ldq, ldk, ldv, ldacc = (q.strides[0] // size, k.strides[0] // size,
                                v.strides[0] // size, acc.strides[0] // size)
        m = 0
        for i in range(blocks.shape[0]):
            k0, k1, r0, r1 = blocks[i, 0], blocks[i, 1], blocks[i, 2], blocks[i, 3]
            keys, rows = k1 - k0, r1 - r0
            gemm(address, NO_TRANS, TRANS, rows, keys, d, alpha,
                  q.ctypes.data + r0 * ldq * size, ldq,
                  k.ctypes.data + k0 * ldk * size, ldk, zero, span.ctypes.data, stride)
            while m < masks.shape[0] and masks[m, 0] == i:  # hidden scores: exp2 gives 0
                key, row, width, height, start = (masks[m, 1], masks[m, 2], masks[m, 3],
                                                  masks[m, 4], masks[m, 5])
                for r in range(height):
                    # a row's slices, indexed from 0 up, and a select: it vectorises
                    # (indexing the whole arrays, it did not)
                    at, flags = (row + r) * stride + key, start + r * width
                    scores, hides = span[at:at + width], hidden[flags:flags + width]
                    for j in range(width):
                        scores[j] = never if hides[j] else scores[j]
                m += 1
            writes = first_writes and i == 0
            if shift.shape[0]:  # a score change by distance, added in the same pass
                exp2_shifted_row_sums(span, stride, keys, sums[r0:r1], writes, c, shift,
                                      origin + k0 - r0)
            else:
                exp2_row_sums(span, stride, keys, sums[r0:r1], writes, c)
            gemm(address, NO_TRANS, NO_TRANS, rows, dv, keys, one, span.ctypes.data, stride,
                  v.ctypes.data + k0 * ldv * size, ldv, zero if writes else one,
                  acc.ctypes.data + r0 * ldacc * size, ldacc)

    return accumulate


def _compile_finish(dtype: Any) -> Any:
    real = numba.from_dtype(np.dtype(dtype))
    matrix, vector = types.Array(real, 2, "C"), types.Array(real, 1, "A")
    signature = types.boolean(matrix, vector, types.float64, matrix, vector)

    @numba.njit(signature, **LOOP_OPTIONS)
    def finish(acc: Any, sums: Any, least: float, out: Any,
               lse: Any) -> bool:  # pragma: no cover - compiled
        rows, dv = out.shape  # acc may hold more columns: the diagonal's sums
        trusted = True  # all rows are checked before any is written
        for i in range(rows):
            s = sums[i]
            trusted &= s >= least and s - s == 0  # NaN fails both, inf the second
            row = acc[i]
            for j in range(dv):
                trusted &= row[j] - row[j] == 0  # NaN or inf give NaN
        if not trusted:
            return False
        for i in range(rows):
            s, row, written = sums[i], acc[i], out[i]
            for j in range(dv):
                written[j] = row[j] / s
        for i in range(lse.shape[0]):
            lse[i] = np.log(sums[i])
        return True

    return finish


#: The dtypes the loops are compiled for.
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_ACCUMULATE = {dt: _compile_accumulate(dt) for dt in DTYPES}
_FINISH = {dt: _compile_finish(dt) for dt in DTYPES}
_NO_SHIFT = {dt: np.empty(0, dt) for dt in DTYPES}


@dataclass(frozen=True)
class CompiledBlocks:
    """The compiled loops, with the address of NumPy's ``cblas_?gemm`` for the call's
    dtype (``_cblas``)."""

    gemm: int

    def accumulate(self, alpha: float, q: Any, k: Any, v: Any, acc: Any, sums: Any,
                   span: Any, stride: int, blocks: Any, masks: Any, hidden: Any, *,
                   first_writes: bool, shift: Any = None, origin: int = 0) -> None:
        """Add each block's weights times values to ``acc`` and their sums to ``sums``.

        ``blocks``: ``(k0, k1, r0, r1)`` rows of int64, keys ``k0:k1`` of ``k`` and
        ``v`` against rows ``r0:r1`` of ``q``, ``acc`` and ``sums``; ``alpha * q``
        holds the queries scaled for base 2. ``masks`` and ``hidden``: the entries of
        the blocks' scores to hide, as ``_scores.pack`` lays them out (weight 0, as if
        the score were ``-inf``). ``span``: the contiguous memory of a tile
        of rows by keys, its rows ``stride`` entries apart. ``first_writes``: the first
        block covers every row and writes ``acc`` and ``sums`` instead of adding to
        them. ``shift``: a score change by distance in the scores' base (a row of
        ``_changes.Shift.forward``; None for none), row ``r``'s entry for key ``k`` at
        ``origin - r + k``. Every matrix's rows must be contiguous (BLAS reads them
        with one leading dimension).
        """
        _ACCUMULATE[q.dtype](self.gemm, alpha, q, k, v, acc, sums, span, stride, blocks,
                             masks, hidden, first_writes,
                             _NO_SHIFT[q.dtype] if shift is None else shift, origin)

    @staticmethod
    def finish(acc: Any, sums: Any, least: float, out: Any, lse: Any) -> bool:
        """``out = acc / sums`` and ``lse = log(sums)`` (``lse`` empty: not asked for)
        when every sum is finite and at least ``least`` and every entry of ``acc``
        finite (``_scores.trustworthy``); False, writing nothing, otherwise. ``acc``
        and ``out`` are C-contiguous; ``acc`` may have more columns than ``out`` (the
        first ones are read)."""
        return bool(_FINISH[acc.dtype](acc, sums, least, out, lse))


def compiled_blocks(dtype: Any) -> CompiledBlocks | None:
    """The loops for ``dtype`` where it is one of :data:`DTYPES` and this process has
    NumPy's BLAS (``_cblas``), else None."""
    gemm = _cblas.gemm_address(np.dtype(dtype)) if np.dtype(dtype) in DTYPES else None
    return None if gemm is None else CompiledBlocks(gemm)
