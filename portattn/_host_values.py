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
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - every supported library brings NumPy
        return None
    for read in (_from_dlpack, _through_cpu, np.asarray):
        try:
            return np.asarray(read(a))
        except Exception:  # the next way of reading is tried
            continue
    return None


def _from_dlpack(a: Any) -> Any:
    import numpy as np

    return np.from_dlpack(a)


def _through_cpu(a: Any) -> Any:
    """Device arrays (torch, CuPy): copied to the CPU first."""
    from array_api_compat import is_cupy_array, is_torch_array

    if is_torch_array(a):
        return a.detach().cpu().numpy()
    if is_cupy_array(a):
        return a.get()
    msg = "not a device array"
    raise TypeError(msg)
