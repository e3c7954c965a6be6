"""Which exponential the scores go through: ``exp2``, unless NumPy computes ``exp``
much faster on this machine.

NumPy vectorises the two for different CPUs. On x86-64 with AVX-512, float32 ``exp2``
takes about 0.2 ns an entry and ``exp`` 0.45 ns; with AVX2 only, ``exp2`` is a scalar
loop (2.2 ns) and ``exp`` a vectorised one (1.0 ns). Every score goes through one of
them, next to about 2.7 ns of matrix products per score at head dim 64, so the wrong
one costs 10-40% of a call. Scores in base 2 only need ``log2(e)`` folded into the
queries, so either works.

The two are timed once per process and dtype, in turns, on an array that takes well
under a millisecond. ``exp`` is taken only when it is clearly faster
(:data:`MARGIN`), so that a moment of load cannot flip the choice, and with it the
last bits of the results, from one run to the next.
"""

from __future__ import annotations

import functools
import math
import time

import numpy as np

__all__ = ["MARGIN", "base2_is_faster", "prefer_base2"]

#: ``exp`` replaces ``exp2`` when it takes less than ``1 / MARGIN`` of its time.
MARGIN = 1.5
_ENTRIES = 1 << 13
_ROUNDS = 5


def prefer_base2(exp2_seconds: float, exp_seconds: float) -> bool:
    """Keep ``exp2`` unless ``exp`` took less than ``1 / MARGIN`` of its time."""
    return exp_seconds * MARGIN > exp2_seconds


@functools.cache
def base2_is_faster(dtype: np.dtype) -> bool:
    """Should scores of ``dtype`` go through ``np.exp2`` (else ``np.exp``) here?"""
    # scores of a typical range: nothing overflows or underflows (slow paths, both)
    x = np.linspace(-30.0, 10.0, _ENTRIES, dtype=dtype)
    out = np.empty_like(x)
    best = {np.exp2: math.inf, np.exp: math.inf}
    for _ in range(_ROUNDS):  # in turns: a moment of load slows both alike
        for ufunc in best:
            start = time.perf_counter()
            ufunc(x, out=out)
            best[ufunc] = min(best[ufunc], time.perf_counter() - start)
    return prefer_base2(best[np.exp2], best[np.exp])
