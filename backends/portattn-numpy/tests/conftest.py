"""Shared fixtures for the numpy_fast tests, and the ``backend``/``xp`` harness of
portattn.testing."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_numpy import _blocks, _plan, _scores, set_num_threads

from portattn import attention
from portattn.testing import assert_close, oracle
from portattn.testing.plugin import backend, xp

__all__ = ["backend", "check", "path", "results_of", "threads", "tiles", "tiny_tiles", "xp"]


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Tiles of a few rows and keys, so small cases cross many tile and block edges:
    query tiles of 4 rows in mask steps of 2, key blocks of 8, mask chunks of 4."""
    monkeypatch.setattr(_plan, "tile_bytes", lambda: 64)
    monkeypatch.setattr(_plan, "MIN_BLOCK_Q", 4)
    monkeypatch.setattr(_plan, "MAX_BLOCK_K", 8)
    monkeypatch.setattr(_blocks, "MASK_CHUNK", 4)
    monkeypatch.setattr(_blocks, "SUB_Q", 2)


@pytest.fixture(params=["fast", "careful"])
def path(request, monkeypatch):
    """Run with the fast way first (the default) or the careful way only."""
    monkeypatch.setattr(_plan, "TRY_FAST", request.param == "fast")
    return request.param


@pytest.fixture
def threads():
    """Set a thread count for one test, restored afterwards."""
    yield set_num_threads
    set_num_threads(None)


@pytest.fixture
def tiles(monkeypatch):
    """Every score tile computed, as ``(batch, head, q0, q1, k0, k1)``."""
    seen: list[tuple] = []
    monkeypatch.setattr(_scores, "on_tile", lambda *tile: seen.append(tile))
    return seen


@pytest.fixture
def results_of(monkeypatch):
    """``results_of(module)``: the results of every call of ``module.attend`` from now
    on (True, or False when the unit was redone the careful way)."""

    def spy(module):
        seen: list[bool] = []
        attend = module.attend

        def counted(*args):
            seen.append(attend(*args))
            return seen[-1]

        monkeypatch.setattr(module, "attend", counted)
        return seen

    return spy


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
