"""Figures for the portable core, each a ratio within one run.

- ``tiled`` vs the textbook NumPy code at (1, 8, 2048, 64) float32 (target <= 0.8).
- causal vs non-causal time with ``tiled`` (target <= 0.7).
- peak traced memory of ``tiled`` at (1, 1, 16384, 64) float32 (target <= 64 MiB).
- dispatch overhead at (1, 8, 64, 64): what ``attention()`` adds to the chosen kernel's
  ``run`` (validation and choice; target <= 15 us), for a first call and for a call
  that repeats an earlier one's signature (remembered).

Run: ``pytest -c pyproject.toml bench/test_core.py --benchmark-group-by=group``. Ratios
are printed at the end of the session.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn._dispatch import choose, described_and_chosen
from portattn._inputs import describe

FIGURES: dict[str, float] = {}


def arrays(shape, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape, dtype=np.float32) for _ in range(3))


def textbook(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])  # a Python float keeps float32
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\nportattn core figures:")
    for name, value in FIGURES.items():
        print(f"    {name}: {value:.3g}")


def timed(benchmark, name, fn, *args, **kwargs):
    benchmark.pedantic(fn, args=args, kwargs=kwargs, rounds=5, warmup_rounds=1)
    FIGURES[f"{name} median s"] = benchmark.stats.stats.median
    return benchmark.stats.stats.median


@pytest.mark.benchmark(group="tiled-vs-textbook")
@pytest.mark.parametrize("impl", ["textbook", "tiled", "tiled_causal"])
def test_tiled_vs_textbook(benchmark, impl):
    q, k, v = arrays((1, 8, 2048, 64))
    if impl == "textbook":
        timed(benchmark, impl, textbook, q, k, v)
    else:
        mask = masks.causal() if impl == "tiled_causal" else None
        timed(benchmark, impl, portattn.attention, q, k, v, mask=mask, kernel="tiled")
    if {"textbook median s", "tiled median s"} <= FIGURES.keys():
        FIGURES["tiled / textbook (target <= 0.8)"] = (
            FIGURES["tiled median s"] / FIGURES["textbook median s"])
    if {"tiled median s", "tiled_causal median s"} <= FIGURES.keys():
        FIGURES["tiled causal / non-causal (target <= 0.7)"] = (
            FIGURES["tiled_causal median s"] / FIGURES["tiled median s"])


def test_tiled_peak_memory():
    q, k, v = arrays((1, 1, 16384, 64))
    tracemalloc.start()
    tracemalloc.reset_peak()
    portattn.attention(q, k, v, kernel="tiled")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    FIGURES["tiled peak MiB at (1, 1, 16384, 64) (target <= 64)"] = peak / 2**20
    FIGURES["textbook score matrix MiB"] = 16384 * 16384 * 4 / 2**20


@pytest.mark.benchmark(group="dispatch-overhead")
@pytest.mark.parametrize("path", ["dispatch", "repeated_dispatch", "kernel_run", "attention"])
def test_dispatch_overhead(benchmark, path):
    # attention() = describe() + choose() + kernel.run(); the first two are the
    # overhead, timed on their own because the kernel's own time varies more than it.
    q, k, v = arrays((1, 8, 64, 64))
    inputs = describe(q, k, v)
    kernel = choose(inputs).kernel
    fn = {"dispatch": lambda: choose(describe(q, k, v)),
          "repeated_dispatch": lambda: described_and_chosen(
              q, k, v, {"mask": None, "scale": None}, None),
          "kernel_run": lambda: kernel.run(inputs),
          "attention": lambda: portattn.attention(q, k, v)}[path]
    benchmark.pedantic(fn, rounds=200, iterations=20, warmup_rounds=5)
    label = {"dispatch": "dispatch overhead (describe + choose) us (target <= 15)",
             "repeated_dispatch": "dispatch overhead, repeated call us (target <= 15)",
             }.get(path, f"{path} ({kernel.name}) median us")
    FIGURES[label] = benchmark.stats.stats.median * 1e6
