"""Dropout in the Triton kernels: the pairs :mod:`portattn.dropout` keeps, hashed from
the seed word, the (batch, head) row and the query and key positions in int32, as every
other kernel draws them, so forward and backward regenerate the same mask per tile."""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from portattn import dropout

__all__ = ["Dropout", "kept", "row_key"]

_M1: tl.constexpr = tl.constexpr(dropout.M1)
_M2: tl.constexpr = tl.constexpr(dropout.M2)
_ROW: tl.constexpr = tl.constexpr(dropout.ROW)
_QUERY: tl.constexpr = tl.constexpr(dropout.QUERY)
_KEY: tl.constexpr = tl.constexpr(dropout.KEY)


class Dropout(NamedTuple):
    """A call's dropout: its seed word (an int32 tensor of shape ``(1,)`` on the
    device) and probability."""

    word: Any
    p: float

    def arguments(self) -> tuple[Any, int, float]:
        """``(Word, drop_threshold, drop_scale)`` as the kernels take them."""
        return self.word, dropout.threshold(self.p), 1.0 / (1.0 - self.p)


@triton.jit
def _mix(h):
    """MurmurHash3's finaliser on int32 (see :func:`portattn.dropout.mix`)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _M1
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _M2
    return h ^ ((h >> 16) & 0xFFFF)


@triton.jit
def row_key(Word, row):
    """The hash of one (batch, query head) row: ``row`` is ``z * Hq + h``."""
    return _mix(_mix(row.to(tl.int32) * _ROW + tl.load(Word)))


@triton.jit
def kept(key, rows, cols, threshold):
    """Kept pairs of query positions ``rows`` and key positions ``cols`` (broadcast
    against each other) in the row hashed to ``key``."""
    h = _mix(_mix(key ^ (rows.to(tl.int32) * _QUERY)) ^ (cols.to(tl.int32) * _KEY))
    return (h & 0x7FFFFFFF) >= threshold
