"""portattn.distributed inside shard_map over 2 and 4 host devices: forward and
gradients (query, key, value, and through the lse) against one float64 call of the
whole sequence, for each strategy. The cases run in a fresh process (the host device
count is fixed when JAX starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

CASES = Path(__file__).with_name("jax_distributed_cases.py")
# each case compiles for seconds: one per strategy (and "auto"), the ring over 4 devices
RUNS = {"causal_gqa_softcap-ring-zigzag": 4, "cross_window-gather-contiguous": 2,
        "causal_gqa-ulysses-zigzag": 2, "causal-auto-zigzag": 2}


@pytest.fixture(scope="module")
def errors():
    done = subprocess.run([sys.executable, os.fspath(CASES), "4", *RUNS],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(RUNS))
def test_matches_one_float64_call(errors, case):
    found = errors[case]
    assert set(found) == {"out", "lse", "dq", "dk", "dv"}
    for name, error in found.items():
        assert error < 1e-12, (RUNS[case], case, name, error)
