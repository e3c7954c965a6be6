"""Choosing the forward's block sizes by timing, for ``flash_forward(..., autotune=True)``.

Each candidate runs with its own block form (tables and bit tiles are per grid), so
the timing is done here rather than by ``triton.autotune``, which would keep one set
of arguments for every candidate. The fastest is remembered per kind of call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from ._configs import Config

__all__ = ["tuned"]

_chosen: dict[Any, Config] = {}


def tuned(kind: Hashable, candidates: list[Config], launch: Callable[[Config], None]) -> Config:
    """The fastest of ``candidates`` for ``launch`` (timed on the first call of each
    ``kind``); those that fail to compile or launch on this device are left out."""
    found = _chosen.get(kind)
    if found is not None:
        return found
    from triton.testing import do_bench

    times = {}
    for config in candidates:
        try:
            times[config] = do_bench(lambda c=config: launch(c))
        except Exception:  # e.g. more shared memory than this device has: not a candidate
            continue
    if not times:
        msg = f"no autotune candidate could run here, of {[str(c) for c in candidates]}"
        raise RuntimeError(msg)
    found = _chosen[kind] = min(times, key=times.get)
    return found
