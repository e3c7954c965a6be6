"""The exponential the scores go through: exp2 unless NumPy's exp is much faster here."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from portattn_numpy import _exponential, configured
from portattn_numpy._plan import build

import portattn


@pytest.fixture
def timed(monkeypatch):
    """``timed(exp2_seconds, exp_seconds)``: the choice made on a machine that seems to
    take these per call of each."""
    def fake(exp2_seconds, exp_seconds):
        # base2_is_faster reads the clock before and after each call, exp2 first
        steps = itertools.cycle([0.0, exp2_seconds, 0.0, exp_seconds])
        clock = itertools.accumulate(steps)
        monkeypatch.setattr(_exponential.time, "perf_counter", lambda: next(clock))
        _exponential.base2_is_faster.cache_clear()
        return _exponential.base2_is_faster(np.dtype(np.float32))

    yield fake
    _exponential.base2_is_faster.cache_clear()


@pytest.mark.parametrize(("exp2_seconds", "exp_seconds", "base2"), [
    (2.2, 1.0, False),   # float32 with AVX2 only: exp2 is a scalar loop
    (0.2, 0.45, True),   # float32 with AVX-512
    (1.2, 1.0, True),    # exp a little faster: not worth results that vary by run
])
def test_exp_replaces_exp2_only_when_clearly_faster(timed, exp2_seconds, exp_seconds,
                                                    base2):
    assert timed(exp2_seconds, exp_seconds) is base2
    assert _exponential.prefer_base2(exp2_seconds, exp_seconds) is base2


def test_the_choice_is_timed_once_per_dtype(monkeypatch):
    _exponential.base2_is_faster.cache_clear()
    calls = []
    monkeypatch.setattr(_exponential, "prefer_base2", lambda *t: calls.append(t) or True)
    for _ in range(3):
        _exponential.base2_is_faster(np.dtype(np.float32))
    _exponential.base2_is_faster(np.dtype(np.float64))
    assert len(calls) == 2
    _exponential.base2_is_faster.cache_clear()


def _planned_base2(q, **kwargs):
    problem, _ = build(portattn.explain(q, q, q, kernel="numpy_fast", **kwargs).inputs)
    return problem.base2


@pytest.mark.parametrize(("exponential", "base2"), [("exp2", True), ("exp", False)])
def test_the_setting_decides(exponential, base2):
    q = np.zeros((1, 1, 8, 4), np.float32)
    with configured(exponential=exponential):
        assert _planned_base2(q) is base2
        # a bias stays in base e, whatever the setting: changing it would cost a pass
        assert _planned_base2(q, bias=np.zeros((8, 8), np.float32)) is False


@pytest.mark.parametrize("base2", [True, False])
def test_by_default_the_measured_choice_is_used(timed, base2):
    timed(1.0, 2.0 if base2 else 0.5)
    assert _planned_base2(np.zeros((1, 1, 8, 4), np.float32)) is base2


def test_a_bad_setting_is_named():
    with pytest.raises(ValueError, match=r"exponential must be .*got exponential='exp10'"), \
            configured(exponential="exp10"):
        pass


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_either_gives_the_oracle_answer(check, exponential, dtype):
    # default tiles: the products at full size, in each base
    check((1, 8, 600, 32), (1, 8, 700, 32), dv=16, dtype=dtype,
          mask=portattn.masks.sliding_window(300, 50), softcap=20.0)
