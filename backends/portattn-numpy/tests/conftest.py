"""Shared fixtures for the numpy_fast tests, and the ``backend``/``xp`` harness of
portattn.testing (importing it also sets ``PORTATTN_TUNE_FILE=""``: dispatch follows
the declared priorities, whatever this machine's tune file says)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from portattn_numpy import configured, set_num_threads

from portattn import attention
from portattn.testing import assert_close, oracle
from portattn.testing.plugin import backend, xp

__all__ = ["backend", "check", "exponential", "path", "results_of", "threads", "tiles",
           "tiny_tiles", "xp"]


@pytest.fixture(autouse=True)
def _two_mib_tiles():
    """Score tiles of 2 MiB, whatever this machine's L2 (``machine_tile_bytes``): the
    plans the tests expect (units, strides, groups) are worked out for that size."""
    with configured(tile_bytes=2 << 20):
        yield


@pytest.fixture
def tiny_tiles():
    """Tiles of a few rows and keys, so small cases cross many tile and block edges:
    query tiles of 4 rows in mask steps of 2, key blocks of 8, mask chunks of 4."""
    with configured(tile_bytes=64, min_block_q=4, preferred_block_q=2, max_block_k=8,
                    mask_chunk=4, mask_step=2) as config:
        yield config


@pytest.fixture(params=["fast", "careful"])
def path(request):
    """Run with the fast way first (the default) or the careful way only."""
    with configured(try_fast=request.param == "fast"):
        yield request.param


_NEEDS_NUMBA = pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                  reason="Numba is not installed")


@pytest.fixture(params=["exp2", "exp", pytest.param("exp2_compiled", marks=_NEEDS_NUMBA),
                        pytest.param("exp_compiled", marks=_NEEDS_NUMBA)])
def exponential(request):
    """Scores through NumPy's ``exp2`` or ``exp``, or a compiled one: each machine gets
    the one that runs fastest there, so all must give the same answers (with a bias,
    an ``exp2`` setting runs the ``exp`` of its kind)."""
    with configured(exponential=request.param):
        yield request.param


@pytest.fixture
def threads():
    """Set a thread count for one test, restored afterwards."""
    yield set_num_threads
    set_num_threads(None)


@pytest.fixture
def tiles():
    """Every score tile computed, as ``(batch, head, q0, q1, k0, k1)``."""
    seen: list[tuple] = []
    with configured(on_tile=lambda *tile: seen.append(tile)):
        yield seen


@pytest.fixture
def results_of():
    """``results_of(strategy)``: from now on, the fast way's result for every unit of
    that strategy (True, or False when the unit was redone the careful way)."""
    seen: dict[str, list[bool]] = {}
    with configured(on_unit=lambda name, trusted: seen.setdefault(name, []).append(trusted)):
        yield lambda name: seen.setdefault(name, [])


@pytest.fixture
def check():
    """``check(q_shape, k_shape, dv=8, dtype="float32", seed=0, **kwargs)``: numpy_fast
    on random inputs against the float64 oracle; returns (out, lse)."""
    return _check


def _check(q_shape, k_shape, dv=8, dtype="float32", seed=0, **kwargs):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal(k_shape).astype(dtype)
    v = rng.standard_normal((*k_shape[:-1], dv)).astype(dtype)
    out, lse = attention(q, k, v, return_lse=True, kernel="numpy_fast", **kwargs)
    wide = {n: (a.astype(np.float64) if n == "bias" else a) for n, a in kwargs.items()}
    want_out, want_lse, _ = oracle(*(a.astype(np.float64) for a in (q, k, v)),
                                   return_lse=True, **wide)
    assert_close(out, want_out, dtype, "out")
    assert_close(lse, want_lse, dtype, "lse")
    return out, lse
