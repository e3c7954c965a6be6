"""A bias added to a score tile held the other way round, compiled with Numba (``pip
install portattn-numpy[jit]``); importing this module without Numba raises
``ImportError``.

Score tiles are keys by queries (``_scores``), a bias is queries by keys. NumPy adds
the transposed view entry by entry down the bias's columns, many times slower than a
copy along its rows. This loop goes through blocks of 8 queries by 256 keys, which
stay in L1 (the fastest of the block shapes and loop orders tried).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types

__all__ = ["add_transposed"]

_QUERIES, _KEYS = 8, 256


def _compile(dtype: Any) -> Any:
    real = numba.from_dtype(np.dtype(dtype))
    signature = types.void(types.Array(real, 2, "A"), types.Array(real, 2, "A", readonly=True))

    @numba.njit(signature, nogil=True, boundscheck=False, cache=True)
    def add(tile: Any, bias: Any) -> None:  # pragma: no cover - compiled
        keys, rows = tile.shape
        for j0 in range(0, rows, _QUERIES):
            j1 = min(rows, j0 + _QUERIES)
            for i0 in range(0, keys, _KEYS):
                for i in range(i0, min(keys, i0 + _KEYS)):
                    for j in range(j0, j1):
                        tile[i, j] += bias[j, i]

    return add


_ADD = {np.dtype(dt): _compile(dt) for dt in (np.float32, np.float64)}


def add_transposed(tile: Any, bias: Any) -> None:
    """``tile += bias.T``: ``tile`` keys by queries, ``bias`` queries by keys (or
    broadcastable to that); NumPy's ``add`` where the dtypes differ or are others."""
    add = _ADD.get(tile.dtype)
    if add is None or bias.dtype != tile.dtype:
        np.add(tile, bias.T, out=tile)
    else:
        add(tile, np.broadcast_to(bias, tile.shape[::-1]))  # a read-only view
