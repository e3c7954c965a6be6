"""Shared fixtures for the numpy_fast tests."""

from __future__ import annotations

import pytest
from portattn_numpy import _blocks, _plan, _scores, set_num_threads


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
