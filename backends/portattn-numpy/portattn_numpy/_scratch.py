"""Memory the workers reuse from call to call.

A fresh large array comes from the operating system, and its first touch costs a page
fault per 4 KiB page, zeroing included: in calls of small heads, stacked into new
arrays, page faults would take a good share of the time. So each thread keeps its
scratch buffers, by name and dtype, grown to the largest size asked for, and held
while the thread lives. The loops share the names ``unit.*`` (a thread runs one
strategy at a time), and the units redone carefully after them use ``careful.*``:
what a thread holds is what one call needed of it, about two score tiles (a few MiB).

Buffers of a MiB or more start on a 2 MiB boundary and ask the system for 2 MiB pages
(``madvise``, Linux), as NumPy does for its own arrays of 4 MiB or more: fewer TLB
misses as BLAS and the exponential sweep each score tile.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["reusing", "take"]

_local = threading.local()

#: Bytes of a huge page on x86-64 and most ARM64 kernels.
_HUGE_PAGE = 2 << 20


@contextlib.contextmanager
def reusing() -> Iterator[None]:
    """One worker's turn: :func:`take` hands out this thread's buffers. A call made
    within it (a hook that runs attention again) gets buffers of its own."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def take(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    """An array of ``shape`` in this thread's buffer ``name``, holding whatever its
    last use left there."""
    state = _local.__dict__
    key = (state.get("depth", 0), name, dtype)
    size = math.prod(shape)
    found = state.setdefault("buffers", {}).get(key)
    if found is None or found.size < size:
        found = state["buffers"][key] = _allocate(size, np.dtype(dtype))
    return found[:size].reshape(shape)


def _allocate(size: int, dtype: np.dtype[Any]) -> Any:
    """``size`` entries, on huge pages where the buffer is large and the system has them."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    nbytes = size * dtype.itemsize
    if advice is None or nbytes < _HUGE_PAGE // 2:
        return np.empty(size, dtype)
    # private (shared anonymous memory follows another huge-page setting), with room
    # to start on a boundary; the pages come at first touch
    length = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE + _HUGE_PAGE
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without huge pages: 4 KiB ones
        region.madvise(advice)
    raw = np.frombuffer(region, np.uint8)  # holds the mapping while any view lives
    start = -raw.ctypes.data % _HUGE_PAGE
    return raw[start:start + nbytes].view(dtype)
