"""The exponential the scores go through: the compiled exp2 where Numba is installed,
else NumPy's exp2, unless another is much faster here; with a bias, an exp."""

from __future__ import annotations

import itertools
import sys
import types
import warnings

import numpy as np
import portattn_numpy
import pytest
from portattn_numpy import _config, _exponential, _jit, configured
from portattn_numpy._plan import build

import portattn

needs_numba = pytest.mark.skipif(_exponential._compiled() is None,
                                 reason="Numba is not installed (portattn-numpy[jit])")


@pytest.fixture
def timed(monkeypatch):
    """``timed(seconds)``: the choice made on a machine where each exponential of
    ``seconds`` (given in ``ORDER``) seems to take that long per call."""
    def fake(seconds):
        monkeypatch.setattr(_exponential, "available",
                            lambda dtype, base_e=False: tuple(seconds))
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
def test_the_compiled_ones_are_candidates_where_numba_imports(monkeypatch, dtype):
    installed = _exponential._compiled() is not None
    assert ("exp2_compiled" in _exponential.available(dtype)) is installed
    assert _exponential.available(dtype, base_e=True) == (
        ("exp_compiled", "exp") if installed else ("exp",))
    monkeypatch.setattr(_exponential, "_compiled", lambda: None)
    assert _exponential.available(dtype) == ("exp2", "exp")
    assert _exponential.available(np.float16) == ("exp2", "exp")


@needs_numba
@pytest.mark.parametrize(("name", "exact"), [("exp2_compiled", np.exp2),
                                             ("exp_compiled", np.exp)])
def test_each_compiled_name_computes_its_own_exponential(name, exact):
    x = np.linspace(-20.0, 20.0, 101, dtype=np.float32)
    got = x.copy()
    _exponential.in_place(name)(got)
    np.testing.assert_allclose(got, exact(x), rtol=3e-7)


def _planned(q, **kwargs):
    """``(base2, exponential)`` of a call's plan."""
    inputs = portattn.explain(q, q, q, kernel="numpy_fast", **kwargs).inputs
    plan = build(inputs, _config.current(), 2 << 20)
    return plan.problem.base2, plan.loops.exponential


@pytest.mark.parametrize(("exponential", "base2", "with_bias"), [
    ("exp2", True, "exp"), ("exp", False, "exp"),
    pytest.param("exp2_compiled", True, "exp_compiled", marks=needs_numba),
    pytest.param("exp_compiled", False, "exp_compiled", marks=needs_numba)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_setting_decides(exponential, base2, with_bias, dtype):
    q = np.zeros((1, 1, 8, 4), dtype)
    with configured(exponential=exponential):
        assert _planned(q) == (base2, _exponential.in_place(exponential))
        # a bias keeps the scores in base e: changing its base would cost a pass
        assert _planned(q, bias=np.zeros((8, 8), dtype)) == (
            False, _exponential.in_place(with_bias))


def _import_compiled_afresh(monkeypatch):
    """Make the next ``_compiled()`` import ``_compiled_exp`` again."""
    monkeypatch.delitem(sys.modules, "portattn_numpy._compiled_exp", raising=False)
    monkeypatch.delattr(portattn_numpy, "_compiled_exp", raising=False)
    _jit.load.cache_clear()


def test_compiled_ones_that_fail_to_load_leave_numpys_with_a_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", types.ModuleType("numba"))  # nothing in it
    _import_compiled_afresh(monkeypatch)
    try:
        with pytest.warns(RuntimeWarning, match="compiled loops of _compiled_exp are unavailable"):
            assert _exponential.available(np.float32) == ("exp2", "exp")
    finally:
        _jit.load.cache_clear()


def test_without_numba_numpys_exponentials_are_used_silently(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba: ModuleNotFoundError
    _import_compiled_afresh(monkeypatch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _exponential.available(np.float32) == ("exp2", "exp")
    finally:
        _jit.load.cache_clear()


@pytest.mark.parametrize("name", ["exp2_compiled", "exp_compiled"])
def test_a_compiled_one_without_numba_is_a_clear_error(monkeypatch, name):
    monkeypatch.setattr(_exponential, "_compiled", lambda: None)
    with configured(exponential=name), pytest.raises(
            ValueError, match=rf"exponential='{name}' needs Numba: pip install "
                              r"'portattn-numpy\[jit\]'"):
        _planned(np.zeros((1, 1, 8, 4), np.float32))


@pytest.mark.parametrize("chosen", ["exp2", "exp"])
def test_by_default_the_measured_choice_is_used(timed, chosen):
    timed({"exp2": 1.0, "exp": 2.0 if chosen == "exp2" else 0.5})
    base2, _ = _planned(np.zeros((1, 1, 8, 4), np.float32))
    assert base2 is (chosen == "exp2")


def test_the_choice_for_a_bias_is_timed_among_exps_only(monkeypatch):
    _exponential.fastest.cache_clear()
    timed = []
    monkeypatch.setattr(_exponential, "prefer", lambda t: timed.append(set(t)) or "exp")
    try:
        assert _exponential.fastest(np.dtype(np.float32), base_e=True) == "exp"
    finally:
        _exponential.fastest.cache_clear()
    assert timed[0] <= {"exp_compiled", "exp"}


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
