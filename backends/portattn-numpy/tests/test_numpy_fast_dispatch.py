"""Installed, numpy_fast is what portattn picks for NumPy float32 and float64 arrays."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_numpy import NumpyFastKernel

import portattn
from portattn import masks


def test_registered_through_the_entry_point():
    entry = {e.name: e for e in portattn.kernels()}["numpy_fast"]
    assert entry.distribution == "portattn-numpy"
    assert isinstance(entry.kernel, NumpyFastKernel)
    assert entry.priority > {e.name: e for e in portattn.kernels()}["tiled"].priority


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chosen_for_numpy_floats(dtype):
    q = np.zeros((2, 4, 16, 8), dtype)
    plan = portattn.explain(q, q, q, mask=masks.causal() & masks.key_lengths(np.array([3, 9])),
                            bias=np.zeros((16, 16), dtype), softcap=3.0, return_lse=True)
    assert plan.kernel.name == "numpy_fast"


def test_not_chosen_where_it_cannot_run():
    q = np.zeros((1, 2, 8, 8), np.float16)
    plan = portattn.explain(q, q, q)
    assert plan.kernel.name != "numpy_fast"
    why = dict((e.name, reasons) for e, reasons in plan.candidates)["numpy_fast"]
    assert why == ("dtype=float16 (supported: float32, float64)",)


def test_weights_fall_back_to_the_reference():
    q = np.zeros((1, 2, 8, 8), np.float32)
    plan = portattn.explain(q, q, q, return_weights=True)
    assert plan.kernel.name == "reference"


def test_attention_runs_it():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 50, 8)).astype(np.float32) for _ in range(3))
    out = portattn.attention(q, k, v, mask=masks.causal())
    with portattn.disable_kernels("numpy_fast"):
        want = portattn.attention(q, k, v, mask=masks.causal())
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_byte_swapped_arrays_reach_the_kernel_in_native_order():
    # the call's description converts them: a value swapped alone crashed the loops
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float32) for _ in range(3))
    assert portattn.explain(q, k, v.astype(">f4")).kernel.name == "numpy_fast"
    out = portattn.attention(q, k, v.astype(">f4"))
    assert out.dtype == np.dtype("float32")
    np.testing.assert_array_equal(out, portattn.attention(q, k, v))
