"""Which exponential the scores go through: a compiled ``exp2`` where Numba is
installed (``_compiled_exp``), else NumPy's ``exp2``, unless another one is much
faster on this machine; with a bias, which keeps scores in base e, the ``exp`` of the
same kind.

NumPy vectorises its two for different CPUs: on x86-64 with AVX-512 its ``exp2`` is
the faster, with AVX2 only its ``exp2`` is a scalar loop and its ``exp`` a vectorised
one; the compiled ``exp2`` is vectorised on either. Every score goes through one of
them, next to only a few matrix-product operations per score, so the wrong one costs
a good share of a call. Scores in base 2 only need ``log2(e)`` folded into the
queries, so any of them works where there is no bias.

The candidates are timed once per process, dtype and base, in turns, on an array that
takes well under a millisecond. A later one in :data:`ORDER` replaces an earlier one
only when it is clearly faster (:data:`MARGIN`), so that a moment of load cannot flip
the choice, and with it the last bits of the results, from one run to the next.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _jit

__all__ = ["BASE_2", "IN_BASE_E", "MARGIN", "ORDER", "available", "chosen", "fastest",
           "in_place", "in_rows", "prefer"]

#: Every exponential, the preferred first.
ORDER = ("exp2_compiled", "exp2", "exp_compiled", "exp")
#: The exponentials of scores in base 2.
BASE_2 = frozenset({"exp2_compiled", "exp2"})
#: For scores that must stay in base e, the ``exp`` of the same kind.
IN_BASE_E = {"exp2_compiled": "exp_compiled", "exp2": "exp"}
#: A later exponential replaces an earlier one when it takes less than ``1 / MARGIN``
#: of its time.
MARGIN = 1.5
_ENTRIES = 1 << 13
_ROUNDS = 5


def available(dtype: Any, base_e: bool = False) -> tuple[str, ...]:
    """The exponentials that can run scores of ``dtype`` here (``base_e``: scores
    that must stay in base e), in :data:`ORDER`."""
    module = _compiled()
    compiled = module is not None and np.dtype(dtype) in module.DTYPES
    return tuple(name for name in ORDER
                 if (compiled or not name.endswith("_compiled"))
                 and not (base_e and name in BASE_2))


def _compiled() -> Any:
    """The module of compiled exponentials; None where it does not load (``_jit``)."""
    return _jit.load("_compiled_exp")


def chosen(setting: str | None, dtype: Any, bias: bool) -> str:
    """The exponential scores of ``dtype`` go through: ``setting``
    (``Config.exponential``), else the fastest here; with a ``bias``, which keeps scores
    in base e, the ``exp`` of the same kind."""
    if setting is None:
        return fastest(np.dtype(dtype), base_e=bias)
    if bias:
        return IN_BASE_E.get(setting, setting)
    return setting


def in_place(name: str) -> Callable[[Any], None]:
    """``f(a)`` replaces the entries of ``a`` by their exponential ``name``."""
    if name.endswith("_compiled"):
        compiled = _compiled_for(name)
        return compiled.exp2_in_place if name == "exp2_compiled" else compiled.exp_in_place
    return _NUMPY[name]


def in_rows(name: str) -> Callable[..., None] | None:
    """``f(span, stride, keys, rows, sums)``: the compiled exponential ``name`` over a
    padded score tile's rows, each column's sum written to ``sums``, in one pass
    (``_compiled_exp.exp2_rows``); None for NumPy's, which take a pass each."""
    if not name.endswith("_compiled"):
        return None
    compiled = _compiled_for(name)
    return compiled.exp2_rows if name == "exp2_compiled" else compiled.exp_rows


def _compiled_for(name: str) -> Any:
    compiled = _compiled()
    if compiled is None:
        msg = f"exponential={name!r} needs Numba: pip install 'portattn-numpy[jit]'"
        raise ValueError(msg)
    return compiled


def _numpy_in_place(ufunc: Any) -> Callable[[Any], None]:
    def run(a: Any) -> None:
        ufunc(a, out=a)
    return run


_NUMPY = {"exp2": _numpy_in_place(np.exp2), "exp": _numpy_in_place(np.exp)}


def prefer(seconds: dict[str, float]) -> str:
    """The first of ``seconds`` (in :data:`ORDER`), unless a later one is
    :data:`MARGIN` times faster than the one chosen so far."""
    chosen = None
    for name in ORDER:
        if name in seconds and (chosen is None or seconds[name] * MARGIN < seconds[chosen]):
            chosen = name
    if chosen is None:
        msg = f"no exponential among {sorted(seconds)}; expected some of {ORDER}"
        raise ValueError(msg)
    return chosen


@functools.cache
def fastest(dtype: np.dtype, base_e: bool = False) -> str:
    """The exponential scores of ``dtype`` go through here (``base_e``: scores that
    must stay in base e; see :func:`prefer`)."""
    # scores of a typical range: nothing overflows or underflows (slow paths, both)
    x = np.linspace(-30.0, 10.0, _ENTRIES, dtype=dtype)
    work = np.empty_like(x)
    runs = {name: in_place(name) for name in available(dtype, base_e)}
    for run in runs.values():  # untimed: a first call pays for its page faults
        work[...] = x
        run(work)
    best = dict.fromkeys(runs, math.inf)
    for _ in range(_ROUNDS):  # in turns: a moment of load slows all alike
        for name, run in runs.items():
            work[...] = x
            start = time.perf_counter()
            run(work)
            best[name] = min(best[name], time.perf_counter() - start)
    return prefer(best)
