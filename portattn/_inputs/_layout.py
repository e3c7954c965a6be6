"""Where the heads axis sits: the two layouts of attention's arrays.

Kernels see one layout, ``(..., heads, length, head_dim)`` ("bhld", torch's). Arrays
held as ``(..., length, heads, head_dim)`` ("blhd": flash-attn, JAX, Flax, xFormers)
are handed over as a transposed view (strides only, no copy on NumPy, torch, CuPy
and Dask) and the output is given back the same way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LAYOUTS", "check_layout", "from_kernel_layout", "shown", "to_kernel_layout"]

LAYOUTS = ("bhld", "blhd")
"""Heads before length (the kernels' own), and length before heads."""


def check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        msg = f"layout must be one of {', '.join(map(repr, LAYOUTS))}; got layout={layout!r}"
        raise ValueError(msg)
    return layout


def to_kernel_layout(layout: Any, *arrays: Any) -> tuple[Any, ...]:
    """``arrays`` as ``(..., heads, length, dim)`` views (unchanged for "bhld")."""
    if check_layout(layout) == "bhld":
        return arrays
    from array_api_compat import array_namespace

    swapped = []
    for a in arrays:
        try:
            xp = array_namespace(a)
        except TypeError:
            swapped.append(a)  # not an array: describe() says so
        else:
            swapped.append(_swap_heads_and_length(xp, a))
    return tuple(swapped)


def from_kernel_layout(xp: Any, layout: str, out: Any) -> Any:
    """A kernel's ``(..., heads, length, dim)`` output in the caller's layout."""
    return out if layout == "bhld" else _swap_heads_and_length(xp, out)


def _swap_heads_and_length(xp: Any, a: Any) -> Any:
    ndim = len(a.shape)
    if ndim < 3:
        return a  # describe() names the array and its rank
    return xp.permute_dims(a, (*range(ndim - 3), ndim - 2, ndim - 3, ndim - 1))


def shown(shape: tuple, layout: str) -> tuple:
    """A kernel-layout ``shape`` as the caller passed it (for error messages)."""
    if layout == "bhld" or len(shape) < 3:
        return shape
    return (*shape[:-3], shape[-2], shape[-3], shape[-1])
