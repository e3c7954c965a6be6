"""The exponential the scores go through: the compiled exp2 where Numba is installed,
else NumPy's exp2, unless another is much faster here."""

from __future__ import annotations

import itertools
import sys
import types
import warnings

import numpy as np
import pytest
from portattn_numpy import _config, _exponential, configured
from portattn_numpy._plan import build

import portattn

needs_numba = pytest.mark.skipif(_exponential._compiled() is None,
                                 reason="Numba is not installed (portattn-numpy[jit])")


@pytest.fixture
def timed(monkeypatch):
    """``timed(seconds)``: the choice made on a machine where each exponential of
    ``seconds`` (given in ``ORDER``) seems to take that long per call."""
    def fake(seconds):
        monkeypatch.setattr(_exponential, "available", lambda dtype: tuple(seconds))
        monkeypatch.setattr(_exponential, "in_place", lambda name: lambda a: None)
        # fastest reads the clock before and after each timed call, in ORDER
        steps = itertools.cycle([t for s in seconds.values() for t in (0.0, s)])
        clock = itertools.accumulate(steps)
        monkeypatch.setattr(_exponential.time, "perf_counter", lambda: next(clock))
        _exponential.fastest.cache_clear()
        return _exponential.fastest(np.dtype(np.float32))

    yield fake
    _exponential.fastest.cache_clear()


@pytest.mark.parametrize(("seconds", "chosen"), [
    # AVX2 only: NumPy's exp2 is a scalar loop
    ({"exp2_compiled": 0.3, "exp2": 2.5, "exp": 1.3}, "exp2_compiled"),
    ({"exp2": 2.2, "exp": 1.0}, "exp"),
    # AVX-512: NumPy's exp2 a little faster than the compiled one, not clearly
    ({"exp2_compiled": 0.25, "exp2": 0.2, "exp": 0.45}, "exp2_compiled"),
    ({"exp2": 0.2, "exp": 0.45}, "exp2"),
    # clearly faster: NumPy's exp2 over the compiled one, exp not over that exp2
    ({"exp2_compiled": 1.0, "exp2": 0.5, "exp": 0.4}, "exp2"),
    ({"exp2_compiled": 1.0, "exp2": 0.9, "exp": 0.5}, "exp"),
    # a little faster is not worth results that vary by run
    ({"exp2": 1.2, "exp": 1.0}, "exp2"),
])
def test_a_later_exponential_replaces_an_earlier_only_when_clearly_faster(timed, seconds,
                                                                         chosen):
    assert timed(seconds) == chosen
    assert _exponential.prefer(seconds) == chosen


def test_prefer_names_what_it_was_given():
    with pytest.raises(ValueError, match=r"no exponential among \['exp3'\]"):
        _exponential.prefer({"exp3": 1.0})


def test_the_choice_is_timed_once_per_dtype(monkeypatch):
    _exponential.fastest.cache_clear()
    calls = []
    monkeypatch.setattr(_exponential, "prefer", lambda t: calls.append(t) or "exp2")
    for _ in range(3):
        _exponential.fastest(np.dtype(np.float32))
    _exponential.fastest(np.dtype(np.float64))
    assert len(calls) == 2
    _exponential.fastest.cache_clear()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_compiled_exp2_is_a_candidate_where_numba_imports(monkeypatch, dtype):
    installed = _exponential._compiled() is not None
    assert ("exp2_compiled" in _exponential.available(dtype)) is installed
    monkeypatch.setattr(_exponential, "_compiled", lambda: None)
    assert _exponential.available(dtype) == ("exp2", "exp")
    assert _exponential.available(np.float16) == ("exp2", "exp")


def _planned(q, **kwargs):
    """``(base2, exponential)`` of a call's problem."""
    problem, _ = build(portattn.explain(q, q, q, kernel="numpy_fast", **kwargs).inputs)
    return problem.base2, problem.exponential


@pytest.mark.parametrize(("exponential", "base2"), [
    ("exp2", True), ("exp", False), pytest.param("exp2_compiled", True, marks=needs_numba)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_setting_decides(exponential, base2, dtype):
    q = np.zeros((1, 1, 8, 4), dtype)
    with configured(exponential=exponential):
        assert _planned(q) == (base2, _exponential.in_place(exponential))
        # a bias stays in base e, whatever the setting: changing it would cost a pass
        assert _planned(q, bias=np.zeros((8, 8), dtype))[0] is False


def test_a_compiled_exp2_that_fails_to_load_leaves_numpys_with_a_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "portattn_numpy._compiled_exp2",
                        types.ModuleType("portattn_numpy._compiled_exp2"))  # nothing in it
    _exponential._compiled.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="the compiled exp2 is unavailable"):
            assert _exponential.available(np.float32) == ("exp2", "exp")
    finally:
        _exponential._compiled.cache_clear()


def test_without_numba_numpys_exponentials_are_used_silently(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba: ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "portattn_numpy._compiled_exp2", raising=False)
    _exponential._compiled.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _exponential.available(np.float32) == ("exp2", "exp")
    finally:
        _exponential._compiled.cache_clear()


def test_the_compiled_exp2_without_numba_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_exponential, "_compiled", lambda: None)
    with configured(exponential="exp2_compiled"), \
            pytest.raises(ValueError, match=r"needs Numba: pip install 'portattn-numpy\[jit\]'"):
        _planned(np.zeros((1, 1, 8, 4), np.float32))


@pytest.mark.parametrize("chosen", ["exp2", "exp"])
def test_by_default_the_measured_choice_is_used(timed, chosen):
    timed({"exp2": 1.0, "exp": 2.0 if chosen == "exp2" else 0.5})
    base2, _ = _planned(np.zeros((1, 1, 8, 4), np.float32))
    assert base2 is (chosen == "exp2")


def test_the_settings_name_every_exponential():
    assert _config._EXPONENTIALS == _exponential.ORDER


def test_a_bad_setting_is_named():
    with pytest.raises(ValueError, match=r"exponential must be .*got exponential='exp10'"), \
            configured(exponential="exp10"):
        pass


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_either_gives_the_oracle_answer(check, exponential, dtype):
    # default tiles: the products at full size, in each base
    check((1, 8, 600, 32), (1, 8, 700, 32), dv=16, dtype=dtype,
          mask=portattn.masks.sliding_window(300, 50), softcap=20.0)
