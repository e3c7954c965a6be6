"""``exp2`` of float32 and float64 arrays in place, compiled with Numba (``pip install
portattn-numpy[jit]``); importing this module without Numba raises ``ImportError``.

NumPy vectorises float32 ``exp2`` only with AVX-512. With AVX2 alone its float32
``exp2`` is a scalar loop (2.5 ns an entry) and its ``exp`` 1.3 ns, next to about
2.9 ns of matrix products per score at head dim 64; its float64 ``exp`` takes 5 ns.
These loops, compiled for the machine they run on, take 0.26-0.35 ns (float32) and
1.0-1.3 ns (float64) there.

``2**x = 2**k * 2**f`` with ``k = round(x)`` and ``|f| <= 1/2``: ``2**f`` by its Taylor
series, ``sum((f ln 2)**n / n!)``, cut where the next term is under a tenth of an ulp
(degree 7 for float32, 13 for float64: under one ulp from the exact value over the
normal range), and ``2**k`` written straight into the exponent bits. Adding
``1.5 * 2**m + bias`` (``m`` mantissa bits) rounds ``x`` and leaves ``k + bias`` in
the low bits of the sum, which a shift by ``m`` moves into the exponent field (the
higher bits fall off the integer). ``x`` is clamped to ``[-bias, bias + 1]``
first, so the field is 0 or all ones at the ends: results under ``2**(0.5 - bias)``
are exactly 0 (the scores' row sums are held far above that, ``_scores.trustworthy``,
so a lost term moves a sum by less than ``2**-26`` of itself), results over
``2**(bias + 0.5)`` are inf, and NaN stays NaN.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

__all__ = ["exp2_in_place"]

_INTEGER = {32: types.int32, 64: types.int64}
_FLOAT = {32: types.float32, 64: types.float64}


@intrinsic
def _bits(typingctx: Any, x: Any) -> Any:
    """A float's bits as the signed integer of its width."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(signature.return_type))
    return _INTEGER[x.bitwidth](x), codegen


@intrinsic
def _float(typingctx: Any, x: Any) -> Any:
    """An integer's bits as the float of its width."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(signature.return_type))
    return _FLOAT[x.bitwidth](x), codegen


def _compile(dtype: Any, degree: int) -> Any:
    """The in-place ``exp2`` of 1-D contiguous arrays of ``dtype``."""
    info = np.finfo(dtype)
    real, integer = info.dtype.type, np.dtype(f"int{info.bits}").type
    bias = info.maxexp - 1
    lowest, highest = real(-bias), real(bias + 1)
    round_biased = real(1.5 * 2.0**info.nmant + bias)
    mantissa_bits = integer(info.nmant)
    # highest power first (Horner's order)
    coeffs = tuple(real(math.log(2) ** n / math.factorial(n)) for n in range(degree, -1, -1))

    # One loop over the array itself (not over an ``out`` that may alias it): LLVM then
    # vectorises it with no overlap check.
    @numba.njit(f"void({info.dtype.name}[::1])", nogil=True, boundscheck=False,
                fastmath={"contract"}, cache=True)
    def exp2(a: Any) -> None:  # pragma: no cover - compiled
        for j in range(a.shape[0]):
            x = a[j]
            x = lowest if x < lowest else x  # written so that NaN passes both
            x = highest if x > highest else x
            biased = x + round_biased
            f = x - (biased - round_biased)  # round(x) comes back exactly
            p = coeffs[0]
            for c in coeffs[1:]:
                p = p * f + c
            a[j] = p * _float(integer(_bits(biased) << mantissa_bits))

    return exp2


_EXP2 = {np.dtype(np.float32): _compile(np.float32, 7),
         np.dtype(np.float64): _compile(np.float64, 13)}


def exp2_in_place(a: Any) -> None:
    """``a[...] = 2**a`` for a C-contiguous float32 or float64 array; NumPy's ``exp2``
    for others."""
    compiled = _EXP2.get(a.dtype)
    if compiled is not None and a.flags.c_contiguous:
        compiled(a.reshape(-1))
    else:
        np.exp2(a, out=a)
