"""The main job: attention on every installed array library, checked against NumPy.

For each backend of the test suite (:mod:`portattn.testing`: the one list of libraries
and devices, so this module names none) it runs a causal, grouped-query call, names the
kernel that ran and prints the largest difference from the float64 NumPy reference.
"""

from __future__ import annotations

from .. import attention, explain, masks

SHAPE_Q, SHAPE_KV = (2, 8, 256, 64), (2, 2, 256, 64)


def run_demo() -> int:
    import numpy as np

    from ..testing import BACKEND_NAMES, get_backend, to_numpy

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in (SHAPE_Q, SHAPE_KV, SHAPE_KV))
    want = attention(*(a.astype(np.float64) for a in (q, k, v)), mask=masks.causal(),
                     kernel="reference")
    print(f"causal grouped-query attention, query {SHAPE_Q}, key/value {SHAPE_KV}, float32")
    print(f"{'library':<18}{'kernel':<22}{'max |out - reference|':>22}")
    worst = 0.0
    for name in BACKEND_NAMES:
        try:
            backend = get_backend(name)
        except ImportError as e:  # the library, or its device, is not here
            print(f"{name:<18}{'(not available)':<22}{e}")
            continue
        try:
            args = [backend.asarray(a) for a in (q, k, v)]
            chosen = explain(*args, mask=masks.causal()).kernel
            out = attention(*args, mask=masks.causal())
            error = float(np.max(np.abs(to_numpy(out).astype(np.float64) - want)))
        except Exception as e:  # a broken library should not hide the others
            print(f"{name:<18}{'failed':<22}{type(e).__name__}: {e}")
            worst = float("inf")
            continue
        worst = max(worst, error)
        print(f"{name:<18}{chosen.name if chosen else '-':<22}{error:>22.2e}")
    ok = worst < 1e-4
    print("agreement with the reference:", "ok" if ok else "FAILED")
    return 0 if ok else 1
