"""Dask backends with chosen chunkings, for the conformance cases, and the
``backend``/``xp`` harness of portattn.testing."""

from __future__ import annotations

import pytest

from portattn.testing import Backend
from portattn.testing.plugin import backend, require_backend, xp

__all__ = ["CHUNKINGS", "backend", "chunked", "chunked_backend", "chunks_for", "make_chunked",
           "xp"]

#: Chunk length per axis kind (batch, heads, sequence, last), None = whole axis. The
#: last axis is the head dim of Q/K/V (split on purpose: the kernel must rejoin it)
#: and the key axis of bias and dense masks.
CHUNKINGS = {
    "batch": (1, None, None, None),
    "heads": (None, 1, None, None),
    "lengths": (None, None, 7, None),
    "everything": (1, 2, 5, 3),
}


def chunks_for(shape: tuple[int, ...], spec: tuple[int | None, ...]) -> tuple[int, ...]:
    batch, heads, length, last = spec
    kinds = (batch,) * len(shape) if len(shape) < 3 else (
        (batch,) * (len(shape) - 3) + (heads, length, last))
    return tuple(max(1, size) if c is None else c for size, c in zip(shape, kinds, strict=True))


def chunked_backend(name: str, spec: tuple[int | None, ...] | None = None) -> Backend:
    """The test suite's dask backend, with arrays split by ``spec`` (default
    ``CHUNKINGS[name]``)."""
    import dask.array as da
    import numpy as np

    base = require_backend("dask")  # fails when selected but missing, else skips
    spec = CHUNKINGS[name] if spec is None else spec

    def make(a, dtype):
        a = np.asarray(a, dtype=dtype) if dtype else np.asarray(a)
        return da.from_array(a, chunks=chunks_for(a.shape, spec))

    return Backend(f"dask-{name}", base.xp, base.dtypes, make)


@pytest.fixture(params=sorted(CHUNKINGS), scope="session")
def chunked(request: pytest.FixtureRequest) -> Backend:
    return chunked_backend(request.param)


@pytest.fixture(scope="session")
def make_chunked():
    """:func:`chunked_backend`, for tests that choose their own chunks."""
    require_backend("dask")
    return chunked_backend
