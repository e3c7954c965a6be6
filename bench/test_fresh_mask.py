"""A new mask every call against one mask reused, in turns, per kernel.

Training on packed batches makes a new ``causal() & documents(ids)`` for every step:
the kernel reads it from scratch (its block form and whatever plan it makes from it),
where a mask reused by every layer is read once. 8 documents of random lengths packed
into L = 16384, (1, 2, L, 64) float32; every new mask holds the same documents in
another order (the same pairs to compute, never seen before). Target: new / reused
<= 1.2 for ``numpy_fast``, ``tiled`` on torch and ``jax_flash``.

Run: ``pytest -c pyproject.toml bench/test_fresh_mask.py -s -p no:cacheprovider``
(``--benchmark-json FILE`` keeps the ratios, in each benchmark's ``extra_info``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import portattn
from portattn import masks

FIGURES: dict[str, float] = {}
L, DOCS, HEADS, D = 16384, 8, 2, 64
KERNELS = {"numpy_fast": "numpy", "tiled": "torch", "jax_flash": "jax"}


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\nnew mask per call figures:")
    for name, value in FIGURES.items():
        print(f"    {name}: {value:.3g}")


def _convert(library: str, a: np.ndarray):
    if library == "torch":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(a)
    if library == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return jnp.asarray(a)
    return a


@pytest.mark.benchmark(group="new mask per call")
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_new_mask_against_reused(in_turns, benchmark, kernel):
    library = KERNELS[kernel]
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, L), DOCS - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [L]]))
    orders = itertools.permutations(range(DOCS))  # 8! orders: never the same mask twice

    def ids():
        return _convert(library, np.repeat(np.arange(DOCS), lengths[list(next(orders))])[None])

    q, k, v = (_convert(library, rng.standard_normal((1, HEADS, L, D), dtype=np.float32))
               for _ in range(3))
    reused = masks.causal() & masks.documents(ids())
    upcoming = [ids() for _ in range(16)]  # made before timing: a step's ids are given

    def new():
        mask = masks.causal() & masks.documents(upcoming.pop())
        # read back on the host: JAX returns before it computes
        return np.asarray(portattn.attention(q, k, v, mask=mask, kernel=kernel))

    def same():
        return np.asarray(portattn.attention(q, k, v, mask=reused, kernel=kernel))

    assert same().shape == new().shape
    best, median = in_turns(new, same, rounds=11)
    FIGURES[f"{kernel}: new / reused (target <= 1.2), best"] = best
    FIGURES[f"{kernel}: new / reused, median of rounds"] = median
    benchmark.extra_info.update(
        shape=f"(1, {HEADS}, {L}, {D}) float32, causal() & documents({DOCS} documents)",
        library=library, new_over_reused_by_minimum=best, median_per_round=median,
        target=1.2)
