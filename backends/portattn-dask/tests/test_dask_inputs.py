"""Calls on Dask arrays that other libraries take as they are: zero-size shapes with
every optional result, and NumPy dtypes in a non-native byte order."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn.testing import assert_close, oracle
from portattn.testing.plugin import require_library

da = require_library("dask.array")
dask = require_library("dask")


@pytest.fixture(autouse=True)
def threaded():
    with dask.config.set(scheduler="threads"):
        yield


@pytest.mark.parametrize(("batch", "q_len", "kv_len"), [
    ((2, 1), 0, 281), ((2, 1), 5, 0), ((1,), 0, 0), ((0, 3), 4, 7)])
def test_zero_size_calls_give_every_result(batch, q_len, kv_len):
    rng = np.random.default_rng(0)
    shapes = ((*batch, 2, q_len, 8), (*batch, 2, kv_len, 8), (*batch, 2, kv_len, 8))
    arrays = [rng.standard_normal(s) for s in shapes]
    q, k, v = (da.from_array(a, chunks=-1) for a in arrays)
    out, lse, weights = portattn.attention(q, k, v, return_lse=True, return_weights=True)
    want_out, want_lse, want_weights = oracle(*arrays, return_lse=True, return_weights=True)
    assert weights.shape == (*batch, 2, q_len, kv_len)
    for got, want in ((out, want_out), (lse, want_lse), (weights, want_weights)):
        np.testing.assert_array_equal(np.asarray(got.compute()), want)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("swapped", ["key_value", "all"])
def test_big_endian_inputs_are_read_in_native_order(dtype, swapped):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((2, 2, 12, 8)).astype(dtype) for _ in range(3)]
    big = np.dtype(dtype).newbyteorder(">")
    given = [a.astype(big) if swapped == "all" or n else a for n, a in enumerate(arrays)]
    q, k, v = (da.from_array(a, chunks=(1, 2, 5, 8)) for a in given)
    out = portattn.attention(q, k, v)
    assert out.dtype == np.dtype(dtype)  # native: what the kernels return
    assert_close(out.compute(), oracle(*arrays)[0], dtype, "out")
