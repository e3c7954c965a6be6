"""The compiled exp2: within an ulp over the normal range, exact ends, in place."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("numba", reason="the compiled exp2 needs Numba (portattn-numpy[jit])")

from portattn_numpy._compiled_exp2 import exp2_in_place

DTYPES = [np.float32, np.float64]
#: Errors in ulps are measured against long double: float64's only where that is more
#: precise (x86-64 Linux), not where it is float64 itself.
MEASURABLE = DTYPES if np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant else [
    np.float32]


def _normal(dtype):
    """Where results are normal floats and the polynomial alone decides the error
    (ends excluded: each rounds to a k whose power of two is 0 or inf)."""
    bias = np.finfo(dtype).maxexp - 1
    return 0.5 - bias, bias + 0.5


def _ulps(got, x):
    exact = np.exp2(x.astype(np.longdouble))  # more precise than float64 on x86-64
    return np.abs(got - exact) / np.spacing(exact.astype(x.dtype))


@pytest.mark.parametrize("dtype", MEASURABLE)
def test_within_an_ulp_over_the_whole_normal_range(dtype):
    x = np.linspace(*_normal(dtype), 3_000_001, dtype=dtype)[1:-1]
    got = x.copy()
    exp2_in_place(got)
    assert _ulps(got, x).max() < 1.0


@given(st.sampled_from(MEASURABLE).flatmap(lambda dtype: hnp.arrays(
    dtype, st.integers(0, 300), elements=st.floats(
        *_normal(dtype), width=np.finfo(dtype).bits, exclude_min=True, exclude_max=True))))
def test_within_an_ulp_for_any_array_length(x):
    got = x.copy()
    exp2_in_place(got)
    assert got.shape == x.shape
    assert np.all(_ulps(got, x) < 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_integers_give_powers_of_two_exactly(dtype):
    lo, hi = _normal(dtype)
    k = np.arange(lo + 0.5, hi, dtype=dtype)
    got = k.copy()
    exp2_in_place(got)
    np.testing.assert_array_equal(got, np.ldexp(dtype(1), k.astype(int)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_ends_flush_to_zero_and_overflow_to_inf_and_nan_stays(dtype):
    lo, hi = _normal(dtype)
    with np.errstate(over="ignore"):  # +-1e300 in float32
        x = np.array([-np.inf, -1e300, lo - 25, lo - 0.1, hi + 0.1, hi + 0.5, 1e300,
                      np.inf, np.nan]).astype(dtype)
    got = x.copy()
    exp2_in_place(got)
    np.testing.assert_array_equal(got[:4], 0.0)
    np.testing.assert_array_equal(got[4:8], np.inf)
    assert np.isnan(got[8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_arrays_of_any_shape_are_changed_in_place(dtype):
    x = np.linspace(-3, 3, 2 * 3 * 5, dtype=dtype).reshape(2, 3, 5)
    got = x.copy()
    exp2_in_place(got)
    np.testing.assert_allclose(got, np.exp2(x), rtol=2 * np.finfo(dtype).eps)


@pytest.mark.parametrize("make", [
    lambda x: x.astype(np.float16),     # another dtype
    lambda x: x.reshape(6, 5)[:, ::2],  # not contiguous
])
def test_other_arrays_go_through_numpy(make):
    base = np.linspace(-3, 3, 30, dtype=np.float32)
    x, got = make(base), make(base.copy())
    exp2_in_place(got)
    np.testing.assert_array_equal(got, np.exp2(x))
