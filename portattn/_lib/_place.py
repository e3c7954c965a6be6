"""Placing arrays in a library, on a device, in a dtype, without naming any library.

Used by the layer and the cache: weights start as NumPy arrays (a seeded generator is
the one portable source of randomness) and move to whatever namespace the caller
names. Moving between two libraries goes through host memory.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import array_namespace, to_device
from array_api_compat import device as device_of

from ._arrays import dtype_name, namespace_name

__all__ = ["check_like", "namespace", "place", "resolve_dtype", "safe_device", "to_host"]


def namespace(xp: Any) -> Any:
    """The array-api-compat namespace for a library module (NumPy when None).

    ``torch``, ``jax.numpy``, ``dask.array``, ``array_api_strict`` or an already
    compatible namespace all work: the namespace of a tiny array made by ``xp`` is the
    one array-api-compat would pick for the library's arrays.
    """
    if xp is None:
        import numpy as xp
    try:
        return array_namespace(xp.zeros(1))
    except (AttributeError, TypeError) as e:
        msg = f"xp must be an array library module such as numpy or torch; got xp={xp!r}"
        raise TypeError(msg) from e


def resolve_dtype(xp: Any, dtype: Any) -> Any:
    """A dtype of ``xp`` from a name (``"float32"``) or from any library's dtype."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    found = getattr(xp, name, None)
    if found is None or not xp.isdtype(found, "real floating"):
        msg = (f"dtype must name a real floating dtype that {namespace_name(xp)} has; "
               f"got dtype={name!r}")
        raise ValueError(msg)
    return found


def to_host(a: Any) -> Any:
    """A NumPy view or copy of any array (copied off an accelerator first when needed).

    bfloat16, which NumPy lacks, comes back as float32.
    """
    import numpy as np

    if dtype_name(getattr(a, "dtype", "")) == "bfloat16":
        xp = array_namespace(a)
        a = xp.astype(a, xp.float32)
    try:
        return np.asarray(a)
    except (TypeError, RuntimeError, ValueError):
        return np.asarray(to_device(a, "cpu"))


def place(a: Any, xp: Any, *, device: Any = None, dtype: Any = None) -> Any:
    """``a`` as a fresh array of namespace ``xp`` (compat), on ``device``, in ``dtype``.

    ``None`` keeps the source's device (same library) or the library default, and the
    source's dtype.
    """
    target = resolve_dtype(xp, a.dtype if dtype is None else dtype)
    try:
        same = namespace_name(array_namespace(a)) == namespace_name(xp)
    except TypeError:  # not an Array API array (e.g. a nested list)
        same = False
    if same:
        out = xp.asarray(xp.astype(a, target), copy=True)
        return out if device is None else to_device(out, device)
    # copy=True: a view of host memory may be read-only (JAX's) or the caller's own.
    host = to_host(a)
    if device is None:
        return xp.asarray(host, dtype=target, copy=True)
    return xp.asarray(host, dtype=target, device=device, copy=True)


def check_like(xp: Any, dev: Any, a: Any, name: str, anchor: str) -> None:
    """``a`` must be an array of ``xp``'s library on device ``dev`` (TypeError/ValueError)."""
    try:
        other = namespace_name(array_namespace(a))
    except TypeError as e:
        msg = (f"{name} must be an array of {anchor}'s library ({namespace_name(xp)}); "
               f"got {type(a).__module__}.{type(a).__name__}")
        raise TypeError(msg) from e
    if other != namespace_name(xp):
        msg = f"{name} must come from {anchor}'s library ({namespace_name(xp)}); got {other}"
        raise TypeError(msg)
    a_dev = safe_device(a)
    if None not in (dev, a_dev) and str(a_dev) != str(dev):
        msg = f"{name} must be on {anchor}'s device ({dev}); got {name}.device={a_dev}"
        raise ValueError(msg)


def safe_device(a: Any) -> Any:
    """``a``'s device, or None for an array that has none to tell (a JAX tracer)."""
    try:
        return device_of(a)
    except Exception:
        return None
