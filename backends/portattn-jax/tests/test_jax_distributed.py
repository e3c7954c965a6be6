"""portattn.distributed inside shard_map over 2 and 4 host devices: forward and
gradients (query, key, value, and through the lse) against one float64 call of the
whole sequence. Each world size runs in a fresh process (the host device count is
fixed when JAX starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

CASES = Path(__file__).with_name("jax_distributed_cases.py")
# one case per device count: each compiles for seconds
RUNS = {2: ["cross_window-gather-contiguous", "causal_gqa-ulysses-zigzag"],
        4: ["causal_gqa_softcap-ring-zigzag"]}


@pytest.fixture(scope="module", params=sorted(RUNS), ids=lambda n: f"{n}devices")
def errors(request):
    size = request.param
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, os.fspath(CASES), str(size), *RUNS[size]],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return size, json.loads(done.stdout.strip().splitlines()[-1])


def test_matches_one_float64_call(errors):
    size, found = errors
    assert set(found) == set(RUNS[size])
    for case, by_name in found.items():
        assert set(by_name) == {"out", "lse", "dq", "dk", "dv"}
        for name, error in by_name.items():
            assert error < 1e-12, (size, case, name, error)
