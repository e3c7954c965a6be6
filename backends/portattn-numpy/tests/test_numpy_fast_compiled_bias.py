"""A bias added to a score tile held the other way round: compiled, or NumPy's add."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_numpy import _jit

pytest.importorskip("numba", reason="the compiled add needs Numba (portattn-numpy[jit])")

from portattn_numpy._compiled_bias import add_transposed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias_shape", [(37, 300), (1, 300), (37, 1), (1, 1)])
def test_the_transposed_bias_is_added_to_a_padded_tile(dtype, bias_shape):
    rng = np.random.default_rng(0)
    keys, rows = 300, 37  # not multiples of the loop's blocks
    tile = rng.standard_normal((keys, rows + 5)).astype(dtype)[:, :rows]  # padded rows
    bias = rng.standard_normal(bias_shape).astype(dtype)
    before = tile.base.copy()
    add_transposed(tile, bias)
    np.testing.assert_array_equal(tile, before[:, :rows] + bias.T)
    np.testing.assert_array_equal(tile.base[:, rows:], before[:, rows:])  # padding kept


def test_a_bias_of_another_dtype_goes_through_numpy():
    tile = np.zeros((8, 4), np.float32)
    bias = np.arange(32, dtype=np.float64).reshape(4, 8)
    add_transposed(tile, bias)
    np.testing.assert_array_equal(tile, bias.T.astype(np.float32))


@pytest.mark.parametrize("numba", [True, False], ids=["compiled", "numpy"])
def test_either_way_a_biased_call_gives_the_oracle_answer(check, numba, monkeypatch):
    from portattn_numpy import _compiled_bias

    load = _jit.load
    if not numba:  # the compiled exponentials stay
        monkeypatch.setattr(_jit, "load", lambda name: None if name == "_compiled_bias"
                            else load(name))
    calls = []
    monkeypatch.setattr(_compiled_bias, "add_transposed",
                        lambda *a: calls.append(1) or add_transposed(*a))
    bias = np.random.default_rng(1).standard_normal((1, 4, 700, 600)).astype(np.float32)
    check((1, 4, 700, 32), (1, 4, 600, 32), dtype="float32", bias=bias)
    assert bool(calls) is numba
