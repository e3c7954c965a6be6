"""Copies of small mask arrays on the host, so a tile plan can follow their values.

Structured masks whose extent lives in arrays (key ranges, per-sequence offsets,
document ids) can only skip tiles once their values are known. They are read here
once, when a mask is bound to a call, wherever they can be read (not while JAX traces,
not inside torch.compile, not from a lazy Dask graph); there the kernels simply visit
every tile, which stays correct. Reading an array on an accelerator waits for it.
"""

from __future__ import annotations

from typing import Any

from ._mask_values import values_readable

__all__ = ["host_copy"]


def host_copy(a: Any) -> Any:
    """``a`` as a NumPy array on the host, or None when its values cannot be read now
    (or NumPy is not installed: the plan is then the conservative one)."""
    if not values_readable(a):
        return None
    from ._convert import to_host  # imports the call description, which imports masks

    try:
        return to_host(a)
    except Exception:  # e.g. no NumPy, or a library that cannot hand its values over
        return None
