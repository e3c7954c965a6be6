"""``exp2`` and ``exp`` of float32 and float64 arrays in place, or of a padded score
tile's rows with each column's sum in the same pass (``exp2_rows``: the weights of
``_scores.ScoreTile.weights``) or each row's (``exp2_row_sums``, and
``exp2_shifted_row_sums`` with a score change added: those of ``_compiled_blocks``),
compiled with Numba (``pip install portattn-numpy[jit]``); importing this module
without Numba raises ``ImportError``.

NumPy vectorises float32 ``exp2`` only with AVX-512 (with AVX2 alone it is a scalar
loop), and its ``exp``, float64's above all, costs a good share of a call next to the
matrix products. These loops are compiled, and vectorised, for the machine they run on.

``2**t = 2**k * 2**f`` with ``k = round(t)`` and ``|f| <= 1/2``, where ``t`` is ``x``
for ``exp2`` and ``x log2(e)`` for ``exp``. ``2**f = e**r`` with ``r = f ln(2)``,
which ``exp`` computes from ``x`` as ``x - k ln(2)`` in two parts (the first exact
for every ``k``, Cody and Waite's reduction), so that rounding ``x log2(e)`` does not
cost accuracy. ``e**r`` is its Taylor series, cut where the next term is under a tenth
of an ulp (degree 7 for float32, 13 for float64: under one ulp from the exact value
over the normal range). ``2**k`` is written straight into the exponent bits: adding
``1.5 * 2**m + bias`` (``m`` mantissa bits) rounds ``t`` and leaves ``k + bias`` in
the low bits of the sum, which a shift by ``m`` moves into the exponent field (the
higher bits fall off the integer). ``t`` is clamped to ``[-bias, bias + 1]`` first, so
the field is 0 or all ones at the ends: results under ``2**(0.5 - bias)`` are exactly
0 (the scores' row sums are held far above that, ``_scores.trustworthy``, so a lost
term moves a sum by less than ``2**-26`` of itself), results over ``2**(bias + 0.5)``
are inf, and NaN stays NaN.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from typing import Any, NamedTuple

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

__all__ = ["DTYPES", "LOOP_OPTIONS", "constants", "exp2_in_place", "exp2_row_sums", "exp2_rows",
           "exp2_shifted_row_sums", "exp_in_place", "exp_rows", "power"]

_INTEGER = {32: types.int32, 64: types.int64}
_FLOAT = {32: types.float32, 64: types.float64}
#: Taylor degree per float width (see above).
_DEGREE = {32: 7, 64: 13}


@intrinsic
def _shifted_bits(typingctx: Any, x: Any, shift: Any) -> Any:
    """A float's bits shifted left by ``shift``, as the signed integer of its width."""
    result = _INTEGER[x.bitwidth]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        bits = builder.bitcast(args[0], context.get_value_type(result))
        return builder.shl(bits, context.cast(builder, args[1], signature.args[1], result))
    return result(x, shift), codegen


@intrinsic
def _float(typingctx: Any, x: Any) -> Any:
    """An integer's bits as the float of its width."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(signature.return_type))
    return _FLOAT[x.bitwidth](x), codegen


class _Constants(NamedTuple):
    """What one exponential needs besides its input (see the module's docstring)."""

    base_e: bool
    x_lowest: Any
    x_highest: Any
    log2e: Any
    lowest: Any
    highest: Any
    round_biased: Any
    hi: Any
    lo: Any
    mantissa_bits: int
    coeffs: tuple[Any, ...]
    zero: Any  # where sums start, of the dtype


@numba.njit(inline="always")
def power(x: Any, c: Any) -> Any:  # pragma: no cover - compiled
    """``e**x`` or ``2**x`` of one entry (``c``: its ``_Constants``). Defined here, not
    in ``_compile``: a nested one would change its callers' cache keys in each process."""
    if c.base_e:
        x = c.x_lowest if x < c.x_lowest else x  # written so that NaN passes
        x = c.x_highest if x > c.x_highest else x
        t = x * c.log2e
    else:
        t = x
    t = c.lowest if t < c.lowest else t
    t = c.highest if t > c.highest else t
    biased = t + c.round_biased
    k = biased - c.round_biased  # round(t), exactly
    r = (x - k * c.hi) - k * c.lo if c.base_e else t - k
    p = c.coeffs[0]
    for coeff in c.coeffs[1:]:
        p = p * r + coeff
    return p * _float(_shifted_bits(biased, c.mantissa_bits))


#: How the loops are compiled, here and in ``_compiled_blocks``.
LOOP_OPTIONS: dict[str, Any] = {"nogil": True, "boundscheck": False,
                                "fastmath": {"contract"}, "cache": True}


@numba.njit(inline="always")
def _rows_of(span: Any, stride: int, keys: int, rows: int, sums: Any,
             c: Any) -> None:  # pragma: no cover - compiled
    """``exp`` or ``exp2`` (``c``: their ``_Constants``) in place of the ``keys x
    rows`` entries of 1-D contiguous ``span`` whose rows start ``stride`` entries apart
    (what lies between is left alone), with each column's sum written to ``sums``
    unless it is empty. Module-level, like :func:`power`.

    The inner loops run over rows themselves (not over an ``out`` that may alias them)
    and sum into a fresh array: LLVM then vectorises them with no overlap check. Rows
    go four at a time, so the sums are read and written once per four rows, not once
    per row.
    """
    summing = sums.shape[0] > 0
    total = np.zeros(rows if summing else 0, span.dtype)
    fours = keys - keys % 4
    for i in range(0, fours, 4):
        r0 = span[i * stride:i * stride + rows]
        r1 = span[(i + 1) * stride:(i + 1) * stride + rows]
        r2 = span[(i + 2) * stride:(i + 2) * stride + rows]
        r3 = span[(i + 3) * stride:(i + 3) * stride + rows]
        for j in range(rows):
            y0, y1 = power(r0[j], c), power(r1[j], c)
            y2, y3 = power(r2[j], c), power(r3[j], c)
            r0[j], r1[j], r2[j], r3[j] = y0, y1, y2, y3
            if summing:
                total[j] += (y0 + y1) + (y2 + y3)
    for i in range(fours, keys):
        row = span[i * stride:i * stride + rows]
        for j in range(rows):
            y = power(row[j], c)
            row[j] = y
            if summing:
                total[j] += y
    if summing:
        sums[:] = total


@numba.njit(**{**LOOP_OPTIONS, "fastmath": {"contract", "reassoc"}})
def exp2_row_sums(span: Any, stride: int, keys: int, sums: Any, first: bool,
                  c: Any) -> None:  # pragma: no cover - compiled
    """``2**x`` in place of the first ``keys`` entries of each row of the 1-D
    contiguous ``span`` (``c``: the ``_Constants`` of ``exp2``), its rows ``stride``
    entries apart and one per entry of ``sums``, which each row's sum is written to
    (``first``) or added to: a tile of scores kept queries by keys becomes its weights
    and their row sums in one pass.

    Compiled on its own, not inlined, so that the sums may be reassociated: LLVM then
    keeps each in the vector lanes (a horizontal sum in a second pass would read the
    row again). That is safe for ``exp2``: the rounding ``(t + C) - C``
    is not folded to ``t`` without ``nsz`` (it differs at ``t = -0``). ``exp``'s
    two-part reduction would be regrouped, so ``c`` must be of base 2. One call takes
    the whole tile: a call per row would pay a call's fixed cost for each short row.
    """
    for j in range(sums.shape[0]):
        row = span[j * stride:j * stride + keys]
        total = c.zero
        for i in range(keys):
            y = power(row[i], c)
            row[i] = y
            total += y
        sums[j] = total if first else sums[j] + total


@numba.njit(**{**LOOP_OPTIONS, "fastmath": {"contract", "reassoc"}})
def exp2_shifted_row_sums(span: Any, stride: int, keys: int, sums: Any, first: bool, c: Any,
                          shift: Any, start: int) -> None:  # pragma: no cover - compiled
    """:func:`exp2_row_sums` of the scores plus a score change that goes by distance:
    row ``j`` gets ``shift[start - j : start - j + keys]`` added, entry by entry,
    before its ``2**x`` (one pass, as without it)."""
    for j in range(sums.shape[0]):
        row = span[j * stride:j * stride + keys]
        added = shift[start - j:start - j + keys]
        total = c.zero
        for i in range(keys):
            y = power(row[i] + added[i], c)
            row[i] = y
            total += y
        sums[j] = total if first else sums[j] + total


def _ln2_parts(info: np.finfo) -> tuple[float, float]:
    """``ln(2)`` as ``hi + lo``, ``hi`` with few enough bits that ``k * hi`` is exact
    for every ``k`` the exponent field holds."""
    with localcontext() as context:
        context.prec = 50
        ln2 = Decimal(2).ln()
    exponent_bits = info.bits - info.nmant - 1
    hi = math.ldexp(math.floor(math.ldexp(float(ln2), info.nmant - exponent_bits)),
                    exponent_bits - info.nmant)
    return hi, float(ln2 - Decimal(hi))


def constants(dtype: Any, base_e: bool) -> _Constants:
    """What ``exp`` (``base_e``) or ``exp2`` of ``dtype`` needs besides its input."""
    info = np.finfo(dtype)
    real = info.dtype.type
    bias = info.maxexp - 1
    lowest, highest = real(-bias), real(bias + 1)
    round_biased = real(1.5 * 2.0**info.nmant + bias)
    hi, lo = _ln2_parts(info)
    log2e = real(1 / math.log(2))
    # exp's x is clamped too, a little wider than t, so that r stays small where 2**k
    # is 0 or inf
    x_lowest, x_highest = real((lowest - 1) * (hi + lo)), real((highest + 1) * (hi + lo))
    hi, lo = real(hi), real(lo)
    # e**r for exp, 2**f = e**(f ln 2) for exp2; highest power first (Horner's order)
    per_power = 1.0 if base_e else math.log(2)
    coeffs = tuple(real(per_power**n / math.factorial(n))
                   for n in range(_DEGREE[info.bits], -1, -1))
    return _Constants(base_e, x_lowest, x_highest, log2e, lowest, highest, round_biased,
                      hi, lo, info.nmant, coeffs, real(0))


def _compile(dtype: Any, base_e: bool) -> Any:
    """``f(span, stride, keys, rows, sums)``: :func:`_rows_of` compiled for
    ``dtype``, ``exp`` (``base_e``) or ``exp2``."""
    c = constants(dtype, base_e)
    name = np.dtype(dtype).name

    @numba.njit(f"void({name}[::1], int64, int64, int64, {name}[:])", **LOOP_OPTIONS)
    def exp(span: Any, stride: int, keys: int, rows: int,
            sums: Any) -> None:  # pragma: no cover - compiled
        _rows_of(span, stride, keys, rows, sums, c)

    return exp


#: The dtypes the loops are compiled for.
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_EXP2 = {dt: _compile(dt, base_e=False) for dt in DTYPES}
_EXP = {dt: _compile(dt, base_e=True) for dt in DTYPES}
_NO_SUMS = {dt: np.empty(0, dt) for dt in DTYPES}


def _in_place(compiled: dict[np.dtype, Any], fallback: Any, a: Any) -> None:
    run = compiled.get(a.dtype)
    if run is not None and a.flags.c_contiguous:
        run(a.reshape(-1), a.size, 1, a.size, _NO_SUMS[a.dtype])
    else:
        fallback(a, out=a)


def exp2_in_place(a: Any) -> None:
    """``a[...] = 2**a`` for a C-contiguous float32 or float64 array; NumPy's ``exp2``
    for others."""
    _in_place(_EXP2, np.exp2, a)


def exp_in_place(a: Any) -> None:
    """``a[...] = e**a`` for a C-contiguous float32 or float64 array; NumPy's ``exp``
    for others."""
    _in_place(_EXP, np.exp, a)


def exp2_rows(span: Any, stride: int, keys: int, rows: int, sums: Any) -> None:
    """``2**x`` in place of the ``keys x rows`` entries of a contiguous float32 or
    float64 ``span`` whose rows start ``stride`` entries apart, with each column's sum
    written to ``sums`` (1-D, any stride; an empty one takes no sums)."""
    _EXP2[span.dtype](span, stride, keys, rows, sums)


def exp_rows(span: Any, stride: int, keys: int, rows: int, sums: Any) -> None:
    """:func:`exp2_rows` with ``e**x``."""
    _EXP[span.dtype](span, stride, keys, rows, sums)
