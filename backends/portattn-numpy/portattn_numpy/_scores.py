"""Score tiles: computing them, masking them, and checking the fast way's sums.

Shared by the strategies (``_tiles``, ``_diagonal``, ``_stacked``). Tiles are kept
keys by queries (``k @ q.T`` runs faster than ``q @ k.T`` in OpenBLAS for these thin
shapes).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ._problem import Problem

__all__ = ["hide", "scores", "trustworthy"]

#: Smallest row sum (relative to the number of keys) the fast way trusts: above it
#: each row's largest term is a normal float with room to spare.
_TINY = {np.dtype(np.float32): 2.0**-100, np.dtype(np.float64): 2.0**-900}


def scores(p: Problem, keys: Any, queries_t: Any, out: Any = None) -> Any:
    """``keys @ queries_t`` into ``out`` (stacked or not; a new array when None),
    softcapped when asked."""
    out = np.matmul(keys, queries_t, out=out)
    if p.softcap is not None:
        np.tanh(out, out=out)
        np.multiply(out, p.softcap, out=out)
    return out


def hide(tile: Any, masks: list[Any], value: float) -> None:
    """Set the masked entries of a (keys by queries) tile to ``value``."""
    for mask in masks:
        if isinstance(mask, tuple):  # positional: (key offset, row offset, hidden)
            k0, r0, hidden = mask
            k1, r1 = k0 + hidden.shape[0], r0 + hidden.shape[1]
            np.copyto(tile[k0:k1, r0:r1], value, where=hidden)
        else:  # dense: allowed, queries by keys
            np.copyto(tile, value, where=np.logical_not(mask.T))


def trustworthy(sums: Any, acc: Any, keys: int, where: Any = True) -> bool:
    """Did the fast way stay in range: no overflow, no row lost to underflow? Only rows
    ``where`` allows are held to the smallest sum (the others attend nothing)."""
    # one NaN or inf anywhere makes a total non-finite (a total that overflows on its
    # own only costs a needless careful pass)
    return bool(np.min(sums, initial=np.inf, where=where) >= _TINY[sums.dtype] * keys
                and math.isfinite(sums.sum()) and math.isfinite(acc.sum()))
