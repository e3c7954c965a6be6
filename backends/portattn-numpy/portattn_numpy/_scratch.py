"""Memory the workers reuse from call to call.

A fresh large array comes from the operating system, and its first touch costs a page
fault per 4 KiB page, zeroing included: in calls of (1, 16, 256, 128), whose heads are
stacked into new arrays, the kernel's page faults took about a quarter of the time. So
each thread keeps its scratch buffers, by name and dtype, grown to the largest size
asked for, and held while the thread lives. The strategies share the names
``unit.*`` (a thread runs one strategy at a time), and the units redone carefully
beside them use ``careful.*``: what a thread holds is what one call needed of it, about
two score tiles (a few MiB).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["reusing", "take"]

_local = threading.local()


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
        found = state["buffers"][key] = np.empty(size, dtype)
    return found[:size].reshape(shape)
