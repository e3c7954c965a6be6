"""Packed documents against the equivalent dense mask, timed in turns in one run.

8 documents of random lengths packed into one row of 4096 tokens, (1, 8, 4096, 64)
float32, causal: ``causal() & documents(ids)`` (the kernel skips the tiles across
documents) against ``dense(allowed)`` holding the same pairs (every tile visited).
Target: documents / dense <= 0.3 with the ``tiled`` kernel. The default dispatch of
the dense call is timed too, for reference (a faster kernel may take dense masks).

Run: ``pytest -c pyproject.toml bench/test_documents.py -s``.
"""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import masks

FIGURES: dict[str, float] = {}
L, DOCS = 4096, 8


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\npacked documents figures:")
    for name, value in FIGURES.items():
        print(f"    {name}: {value:.3g}")


def packed_call():
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, L), DOCS - 1, replace=False))
    ids = np.repeat(np.arange(DOCS), np.diff(np.concatenate([[0], cuts, [L]])))[None]
    q, k, v = (rng.standard_normal((1, 8, L, 64), dtype=np.float32) for _ in range(3))
    allowed = (ids[0][:, None] == ids[0][None, :]) & np.tri(L, dtype=bool)
    return (q, k, v), masks.causal() & masks.documents(ids), masks.dense(allowed)


@pytest.mark.benchmark(group="documents")
@pytest.mark.parametrize("peer_kernel", ["tiled", None])
def test_documents_vs_dense(in_turns, peer_kernel):
    arrays, structured, dense = packed_call()
    np.testing.assert_allclose(portattn.attention(*arrays, mask=structured, kernel="tiled"),
                               portattn.attention(*arrays, mask=dense, kernel="tiled"),
                               rtol=1e-5, atol=1e-6)
    best, median = in_turns(
        lambda: portattn.attention(*arrays, mask=structured, kernel="tiled"),
        lambda: portattn.attention(*arrays, mask=dense, kernel=peer_kernel), rounds=3)
    name = peer_kernel or portattn.explain(*arrays, mask=dense).kernel.name
    target = " (target <= 0.3)" if peer_kernel == "tiled" else ""
    FIGURES[f"documents (tiled) / dense ({name}){target}, best"] = best
    FIGURES[f"documents (tiled) / dense ({name}), median of rounds"] = median
