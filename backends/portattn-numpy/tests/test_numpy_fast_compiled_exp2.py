"""The compiled float32 exp2: within an ulp over the normal range, exact ends, in place."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("numba", reason="the compiled exp2 needs Numba (portattn-numpy[jit])")

from portattn_numpy._compiled_exp2 import exp2_in_place

#: Where results are normal floats and the polynomial alone decides the error (ends
#: excluded: each rounds to a k whose power of two is 0 or inf).
NORMAL = (-126.5, 127.5)


def _ulps(got, x):
    exact = np.exp2(x.astype(np.float64))
    return np.abs(got.astype(np.float64) - exact) / np.spacing(exact.astype(np.float32))


def test_within_an_ulp_over_the_whole_normal_range():
    x = np.linspace(*NORMAL, 3_000_001, dtype=np.float32)[1:-1]
    got = x.copy()
    exp2_in_place(got)
    assert _ulps(got, x).max() < 1.0


@given(hnp.arrays(np.float32, st.integers(0, 300),
                  elements=st.floats(*NORMAL, width=32, exclude_min=True,
                                            exclude_max=True)))
def test_within_an_ulp_for_any_array_length(x):
    got = x.copy()
    exp2_in_place(got)
    assert got.shape == x.shape
    assert np.all(_ulps(got, x) < 1.0)


def test_integers_give_powers_of_two_exactly():
    k = np.arange(-126, 128, dtype=np.float32)
    got = k.copy()
    exp2_in_place(got)
    np.testing.assert_array_equal(got, np.ldexp(np.float32(1), k.astype(int)))


def test_the_ends_flush_to_zero_and_overflow_to_inf_and_nan_stays():
    x = np.array([-np.inf, -1e30, -150, -126.6, 127.6, 128, 1e30, np.inf, np.nan],
                 np.float32)
    got = x.copy()
    exp2_in_place(got)
    np.testing.assert_array_equal(got[:4], 0.0)
    np.testing.assert_array_equal(got[4:8], np.inf)
    assert np.isnan(got[8])


def test_contiguous_arrays_of_any_shape_are_changed_in_place():
    x = np.linspace(-3, 3, 2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)
    got = x.copy()
    exp2_in_place(got)
    np.testing.assert_allclose(got, np.exp2(x), rtol=2e-7)


@pytest.mark.parametrize("make", [
    lambda x: x.astype(np.float64),     # another dtype
    lambda x: x.reshape(6, 5)[:, ::2],  # not contiguous
])
def test_other_arrays_go_through_numpy(make):
    base = np.linspace(-3, 3, 30, dtype=np.float32)
    x, got = make(base), make(base.copy())
    exp2_in_place(got)
    np.testing.assert_array_equal(got, np.exp2(x))
