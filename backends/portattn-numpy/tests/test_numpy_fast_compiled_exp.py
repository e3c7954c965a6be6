"""The compiled exp2 and exp: within an ulp over the normal range, exact ends, in place;
over a padded tile's rows with their column sums, or with each row's sum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("numba", reason="the compiled exponentials need Numba (portattn-numpy[jit])")

from portattn_numpy._compiled_exp import (
    constants,
    exp2_in_place,
    exp2_row_sums,
    exp2_rows,
    exp_in_place,
    exp_rows,
)

DTYPES = [np.float32, np.float64]
#: Errors in ulps are measured against long double: float64's only where that is more
#: precise (x86-64 Linux), not where it is float64 itself.
MEASURABLE = DTYPES if np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant else [
    np.float32]
#: Each compiled exponential, with NumPy's for the exact value and ``log(base)``.
FUNCTIONS = {"exp2": (exp2_in_place, np.exp2, np.log(2.0)), "exp": (exp_in_place, np.exp, 1.0)}
#: The same over a tile's rows, with their column sums.
ROWS = {"exp2": exp2_rows, "exp": exp_rows}


def _normal(dtype, function):
    """Where results are normal floats and the polynomial alone decides the error
    (ends excluded: each rounds to a power of two that is 0 or inf)."""
    bias = np.finfo(dtype).maxexp - 1
    per_unit = np.log(2.0) / FUNCTIONS[function][2]  # inputs per power of two
    return (0.5 - bias) * per_unit, (bias + 0.5) * per_unit


def _ulps(function, got, x):
    exact = FUNCTIONS[function][1](x.astype(np.longdouble))  # more precise than float64
    return np.abs(got - exact) / np.spacing(exact.astype(x.dtype))


def _run(function, x):
    got = x.copy()
    FUNCTIONS[function][0](got)
    return got


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("dtype", MEASURABLE)
def test_within_an_ulp_over_the_whole_normal_range(dtype, function):
    x = np.linspace(*_normal(dtype, function), 3_000_001).astype(dtype)[1:-1]
    assert _ulps(function, _run(function, x), x).max() < 1.0


@st.composite
def _cases(draw):
    """``(function, x)``: an array of inputs whose results are normal floats."""
    dtype = draw(st.sampled_from(MEASURABLE))
    function = draw(st.sampled_from(list(FUNCTIONS)))
    lo, hi = (float(dtype(end)) for end in _normal(dtype, function))
    elements = st.floats(lo, hi, width=np.finfo(dtype).bits, exclude_min=True,
                         exclude_max=True)
    return function, draw(hnp.arrays(dtype, st.integers(0, 300), elements=elements))


@given(_cases())
def test_within_an_ulp_for_any_array_length(case):
    function, x = case
    got = _run(function, x)
    assert got.shape == x.shape
    assert np.all(_ulps(function, got, x) < 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_integers_give_powers_of_two_exactly(dtype):
    lo, hi = _normal(dtype, "exp2")
    k = np.arange(lo + 0.5, hi, dtype=dtype)
    np.testing.assert_array_equal(_run("exp2", k), np.ldexp(dtype(1), k.astype(int)))


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_ends_flush_to_zero_and_overflow_to_inf_and_nan_stays(dtype, function):
    lo, hi = _normal(dtype, function)
    width = hi - lo
    with np.errstate(over="ignore"):  # +-1e300 in float32
        x = np.array([-np.inf, -1e300, lo - width / 10, lo * 1.001, hi * 1.001,
                      hi + width / 10, 1e300, np.inf, np.nan]).astype(dtype)
    got = _run(function, x)
    np.testing.assert_array_equal(got[:4], 0.0)
    np.testing.assert_array_equal(got[4:8], np.inf)
    assert np.isnan(got[8])


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_arrays_of_any_shape_are_changed_in_place(dtype, function):
    x = np.linspace(-3, 3, 2 * 3 * 5, dtype=dtype).reshape(2, 3, 5)
    np.testing.assert_allclose(_run(function, x), FUNCTIONS[function][1](x),
                               rtol=2 * np.finfo(dtype).eps)


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("make", [
    lambda x: x.astype(np.float16),     # another dtype
    lambda x: x.reshape(6, 5)[:, ::2],  # not contiguous
])
def test_other_arrays_go_through_numpy(make, function):
    base = np.linspace(-3, 3, 30, dtype=np.float32)
    x, got = make(base), make(base.copy())
    FUNCTIONS[function][0](got)
    np.testing.assert_array_equal(got, FUNCTIONS[function][1](x))


@st.composite
def _tiles(draw):
    """``(function, span, stride, keys, rows)``: a padded tile of scores in its span."""
    dtype = draw(st.sampled_from(DTYPES))
    keys, rows = draw(st.integers(0, 40)), draw(st.integers(0, 40))
    stride = rows + draw(st.integers(0, 9))
    scores = st.floats(-60, 60, width=np.finfo(dtype).bits)
    span = draw(hnp.arrays(dtype, keys * stride, elements=scores))
    return draw(st.sampled_from(list(ROWS))), span, stride, keys, rows


@given(_tiles())
def test_rows_exponentiate_the_tile_and_sum_its_columns_leaving_the_padding(case):
    function, span, stride, keys, rows = case
    before = span.reshape(keys, stride) if keys else np.empty((0, stride), span.dtype)
    before = before.copy()
    sums = np.full(rows, np.nan, span.dtype)
    ROWS[function](span, stride, keys, rows, sums)
    after = span.reshape(before.shape)
    expected = before[:, :rows].copy()
    FUNCTIONS[function][0](expected)  # the in-place loop: the same bits
    np.testing.assert_array_equal(after[:, :rows], expected)
    np.testing.assert_array_equal(after[:, rows:], before[:, rows:])
    eps = np.finfo(span.dtype).eps
    np.testing.assert_allclose(sums, expected.sum(axis=0), rtol=keys * eps, atol=0)


@pytest.mark.parametrize("keys", range(1, 10))
@pytest.mark.parametrize("function", list(ROWS))
def test_rows_in_fours_and_the_rows_left_over_agree_with_the_single_loop(function, keys):
    """Rows are taken four at a time, then one at a time: every count of rows left over
    gives the in-place loop's bits, and sums of every row."""
    rng = np.random.default_rng(keys)
    span = rng.uniform(-20, 20, keys * 37).astype(np.float32)
    expected = span.reshape(keys, 37)[:, :33].copy()
    FUNCTIONS[function][0](expected)
    sums = np.empty(33, np.float32)
    ROWS[function](span, 37, keys, 33, sums)
    np.testing.assert_array_equal(span.reshape(keys, 37)[:, :33], expected)
    np.testing.assert_allclose(sums, expected.astype(np.float64).sum(axis=0),
                               rtol=keys * np.finfo(np.float32).eps)


@pytest.mark.parametrize("function", list(ROWS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_sum_into_a_strided_column_and_read_minus_inf_as_zero(dtype, function):
    span = np.linspace(-5, 5, 6 * 8, dtype=dtype)
    span[[3, 17]] = -np.inf  # hidden scores
    table = np.full((5, 3), 7, dtype)  # sums go to its middle column
    expected = span.reshape(6, 8)[:, :5].copy()
    FUNCTIONS[function][0](expected)
    ROWS[function](span, 8, 6, 5, table[:, 1])
    assert span[3] == span[17] == 0
    np.testing.assert_allclose(table[:, 1], expected.sum(axis=0), rtol=8 * np.finfo(dtype).eps)
    np.testing.assert_array_equal(table[:, [0, 2]], 7)


@pytest.mark.parametrize("function", list(ROWS))
def test_rows_without_a_place_for_sums_only_exponentiate(function):
    span = np.linspace(-3, 3, 12, dtype=np.float32)
    expected = span.copy()
    FUNCTIONS[function][0](expected)
    ROWS[function](span, 4, 3, 4, np.empty(0, np.float32))
    np.testing.assert_array_equal(span, expected)


def _row_sum(row):
    total = np.zeros(1, row.dtype)
    exp2_row_sums(row, len(row), len(row), total, True, constants(row.dtype, base_e=False))
    return total[0]


@given(st.sampled_from(DTYPES).flatmap(lambda dtype: hnp.arrays(
    dtype, st.integers(0, 80), elements=st.floats(-1100, 1100, width=np.finfo(dtype).bits)
    | st.sampled_from([np.nan, np.inf, -np.inf, -0.0, 0.5, -0.5, 126.5, -126.5]))))
@example(np.array([1023.5, 1023.5]))  # finite weights whose sum overflows
@settings(deadline=None)  # the first call of each dtype compiles the loop
def test_a_row_gets_the_in_place_bits_and_their_sum(row):
    """The loop whose sum may be reassociated keeps exp2's own rounding: the same bits
    as the in-place loop for every input, and the sum of those."""
    expected = row.copy()
    exp2_in_place(expected)
    total = _row_sum(row)
    np.testing.assert_array_equal(row, expected)
    with np.errstate(over="ignore"):  # float64 terms may add up past its largest
        exact = expected.astype(np.float64).sum()
    if exact <= np.finfo(row.dtype).max:
        np.testing.assert_allclose(total, exact, rtol=max(len(row), 1) * np.finfo(row.dtype).eps)
    else:  # NaN, or more than the dtype holds
        np.testing.assert_array_equal(total, np.nan if np.isnan(exact) else np.inf)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_of_halves_rounds_like_the_in_place_loop(dtype):
    """Ties, where folding ``(t + C) - C`` into ``t`` would give another power of two
    than the exponent bits hold (a result off by 2x), and -0."""
    row = np.concatenate([np.arange(-140, 140, dtype=dtype) + dtype(0.5), [dtype(-0.0)]])
    expected = row.copy()
    exp2_in_place(expected)
    _row_sum(row)
    np.testing.assert_array_equal(row, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("first", [True, False])
def test_rows_of_a_tile_get_their_sums_and_leave_the_padding(dtype, first):
    """Three rows of five keys, eight entries apart: each row's ``exp2`` and its sum,
    written or added to what ``sums`` holds; the padding between rows stays."""
    span = np.linspace(-4, 4, 24, dtype=dtype)
    table = span.reshape(3, 8)
    weights = np.ascontiguousarray(table[:, :5])  # the compiled loop's (NumPy's for views)
    exp2_in_place(weights)
    expected = table.copy()  # its padding is the original's
    expected[:, :5] = weights
    sums = np.full(4, 10, dtype)
    exp2_row_sums(span, 8, 5, sums[1:], first, constants(dtype, base_e=False))
    np.testing.assert_array_equal(table, expected)
    np.testing.assert_allclose(sums[1:], weights.sum(axis=1) + (0 if first else 10),
                               rtol=8 * np.finfo(dtype).eps)
    assert sums[0] == 10
