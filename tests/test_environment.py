"""The test environment holds what its name says (a tox env named after a backend must
have that backend, and the example plugin installed)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import portattn
from portattn.testing import assert_close, get_backend, oracle
from portattn.testing.plugin import selected_backends

ENV_BACKENDS = {"numpy": ("numpy",), "strict": ("array_api_strict",), "torch": ("torch",),
                "jax": ("jax",), "dask": ("dask",), "cross": ("numpy", "torch")}
TOX_ENV = os.environ.get("TOX_ENV_NAME", "")


@pytest.mark.cross
@pytest.mark.skipif(TOX_ENV not in ENV_BACKENDS, reason="not a backend tox env")
def test_tox_env_has_its_backend():
    for name in ENV_BACKENDS[TOX_ENV]:
        assert name in (selected_backends() or ())
        get_backend(name)  # raises ImportError when the env lacks its library


def test_example_plugin_runs_through_its_entry_point():
    entry = next((e for e in portattn.kernels() if e.name == "example_einsum"), None)
    if entry is None:
        if TOX_ENV:
            pytest.fail("tests/example_plugin must be installed in every tox env")
        pytest.skip("tests/example_plugin is not installed")
    assert (entry.distribution, entry.version) == ("portattn-example", "0.1.0")
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, 5, 8)) for _ in range(3))
    calls = type(entry.kernel).calls
    out, lse = portattn.attention(q, k, v, kernel="example_einsum", return_lse=True)
    assert type(entry.kernel).calls == calls + 1
    want_out, want_lse, _ = oracle(q, k, v)
    assert_close(out, want_out, "float64")
    assert_close(lse, want_lse, "float64", "lse")
