"""Stored plans stay within a byte budget, whatever shapes the calls have."""

from __future__ import annotations

import numpy as np
from portattn_numpy import _memo

import portattn
from portattn import masks


def test_a_store_holds_at_most_its_bytes(monkeypatch):
    monkeypatch.setattr(_memo, "MAX_BYTES", 1 << 20)
    store = _memo.Store("test plans")
    try:
        for i in range(64):  # 64 plans of 64 KiB: 4 MiB asked, 1 MiB allowed
            store.get(("shape", i), lambda: (np.zeros(8192), [np.ones(4)]))
            assert store.nbytes <= 1 << 20
        assert 0 < len(store) < 64
        assert store.find(("shape", 63)) is not None  # the newest is kept
        store.put(("huge",), np.zeros(1 << 18))  # larger than the whole budget: not kept
        assert store.find(("huge",)) is None
    finally:
        _memo._stores.remove(store)


def test_size_of_counts_arrays_inside_objects_once():
    shared = np.zeros(1000)

    class Plan:  # stands for a plan of the package
        __module__ = _memo.__name__

        def __init__(self) -> None:
            self.rows, self.again, self.cols = shared, shared, (shared[:10].copy(),)

    assert 8000 + 80 < _memo.size_of(Plan()) < 8000 + 80 + 2000


def test_a_plan_of_blocks_counts_its_masks():
    # a unit's plan counts its bytes itself (walking every block of every stored plan
    # would cost as much as planning a new mask): at least the entries it masks
    from portattn_numpy._units import UnitBlocks

    hidden = np.ones((128, 256), bool)
    plan = UnitBlocks([(0, 256, 0, 128, [(0, 0, hidden)]), (256, 512, 0, 128, [])], 0, 128)
    assert hidden.nbytes < _memo.size_of(plan) < hidden.nbytes + 2000


def test_calls_of_many_shapes_keep_the_stores_bounded(monkeypatch):
    monkeypatch.setattr(_memo, "MAX_BYTES", 256 << 10)
    _memo.clear_all()
    for length in range(64, 640, 9):
        q = np.ones((1, 2, length, 16), np.float32)
        portattn.attention(q, q, q, mask=masks.causal(), kernel="numpy_fast")
    assert all(store.nbytes <= 256 << 10 for store in _memo._stores)
