"""``exp2`` of float32 arrays in place, compiled with Numba (``pip install
portattn-numpy[jit]``); importing this module without Numba raises ``ImportError``.

NumPy vectorises float32 ``exp2`` only with AVX-512. With AVX2 alone its ``exp2`` is a
scalar loop (2.5 ns an entry) and its ``exp`` 1.3 ns, next to about 2.9 ns of matrix
products per score at head dim 64; this loop, compiled for the machine it runs on,
takes 0.35-0.45 ns there.

``2**x = 2**k * 2**f`` with ``k = round(x)`` and ``|f| <= 1/2``: ``2**f`` by a
polynomial of degree 6 that interpolates it at Chebyshev points (under one ulp from
the exact value over the normal range), ``2**k`` written straight into the exponent
bits. Adding ``1.5 * 2**23 + 127`` rounds ``x`` and leaves ``k + 127`` in the low
bits of the sum, which a shift by 23 moves into the exponent field (the higher bits
fall off the 32-bit integer). ``x`` is clamped to ``[-127, 128]`` first, so the field
is 0 or 255 at the ends: results under ``2**-126.5`` are exactly 0 (the scores' row
sums are held above ``2**-100`` a key, ``_scores.trustworthy``, so a lost term moves a
sum by less than ``2**-26`` of itself), results over ``2**127.5`` are inf, and NaN
stays NaN.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

__all__ = ["exp2_in_place"]

_HALF = [-0.5, 0.5]
_P = np.polynomial
#: ``2**f`` on ``[-1/2, 1/2]``, highest power first (Horner's order).
_COEFFS = tuple(np.float32(c) for c in _P.Chebyshev.interpolate(np.exp2, 6, domain=_HALF)
                .convert(kind=_P.Polynomial, domain=_HALF, window=_HALF).coef[::-1])
_LOWEST, _HIGHEST = np.float32(-127.0), np.float32(128.0)
_ROUND_BIASED = np.float32(1.5 * 2**23 + 127)
_MANTISSA_BITS = np.int32(23)


@intrinsic
def _bits(typingctx: Any, x: Any) -> Any:
    """A float32's bits as an int32."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(types.int32))
    return types.int32(x), codegen


@intrinsic
def _float(typingctx: Any, x: Any) -> Any:
    """An int32's bits as a float32."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(x), codegen


# One loop over the array itself (not over an ``out`` that may alias it): LLVM then
# vectorises it with no overlap check.
@numba.njit("void(float32[::1])", nogil=True, boundscheck=False, fastmath={"contract"},
            cache=True)
def _exp2(a: Any) -> None:  # pragma: no cover - compiled
    c6, c5, c4, c3, c2, c1, c0 = _COEFFS
    for j in range(a.shape[0]):
        x = a[j]
        x = _LOWEST if x < _LOWEST else x  # written so that NaN passes both
        x = _HIGHEST if x > _HIGHEST else x
        biased = x + _ROUND_BIASED
        f = x - (biased - _ROUND_BIASED)  # round(x) comes back exactly
        p = ((((((c6 * f + c5) * f + c4) * f + c3) * f + c2) * f + c1) * f + c0)
        a[j] = p * _float(np.int32(_bits(biased) << _MANTISSA_BITS))


def exp2_in_place(a: Any) -> None:
    """``a[...] = 2**a`` for a C-contiguous float32 array; NumPy's ``exp2`` for others."""
    if a.dtype == np.float32 and a.flags.c_contiguous:
        _exp2(a.reshape(-1))
    else:
        np.exp2(a, out=a)

