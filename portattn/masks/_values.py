"""The values masks hold: arguments taken as arrays (or Python integers), integers
checked wherever they can be read and kept in signed dtypes (arithmetic on unsigned
lengths would wrap around), and a bound mask's values as a dictionary key.

Values cannot be read while JAX traces, inside torch.compile, or from a lazy Dask
graph; there the masks keep no copy and the kernels visit every tile the structure
alone does not rule out, which stays correct. Reading an array on an accelerator waits
for it. What it knows of array libraries comes from :mod:`portattn._lib`.
"""

from __future__ import annotations

import math
from typing import Any

from .._lib import device_text, dtype_name, host_copy, namespace_name, values_readable

__all__ = ["CONTENT_BYTES", "Content", "array_argument", "check_bounds", "check_integer_array",
           "check_range", "content_of", "signed"]


def signed(xp: Any, lengths: Any) -> Any:
    """``lengths`` in a signed integer dtype: unsigned ones wrap around on subtraction.

    Args:
        xp: the array namespace of ``lengths``.
        lengths: an integer array.

    Returns:
        ``lengths`` itself when its dtype is signed; else a copy in int32 (8 and 16
        bits) or int64 (32 and 64 bits).

    Example:
        >>> import numpy as np
        >>> from portattn.masks._values import signed
        >>> signed(np, np.array([3, 5], dtype=np.uint8)).dtype
        dtype('int32')
        >>> signed(np, np.array([3, 5], dtype=np.int16)).dtype
        dtype('int16')
    """
    if not xp.isdtype(lengths.dtype, "unsigned integer"):
        return lengths
    bits = xp.iinfo(lengths.dtype).bits
    return xp.astype(lengths, xp.int32 if bits <= 16 else xp.int64)


def check_range(xp: Any, lengths: Any, limit: int, kind: str) -> None:
    """Check that lengths lie in ``[0, limit]``, wherever the values are readable.

    Traced and lazy arrays are not checked: there a length out of range acts as if
    clipped to it.

    Args:
        xp: the array namespace of ``lengths``.
        lengths: an integer array.
        limit: the largest length allowed (``Lk`` or ``Lq``).
        kind: ``"key_lengths"`` (the limit is ``Lk``) or another kind's name (the
            limit is ``Lq``), for the error message.

    Raises:
        ValueError: a length lies outside ``[0, limit]``.

    Example:
        >>> import numpy as np
        >>> from portattn.masks._values import check_range
        >>> check_range(np, np.array([3, 8]), 8, "key_lengths")
        >>> check_range(np, np.array([3, 9]), 8, "key_lengths")
        Traceback (most recent call last):
        ...
        ValueError: key_lengths lengths must lie in [0, Lk=8]; got key_lengths with min=3, max=9
    """
    length_name = "Lk" if kind == "key_lengths" else "Lq"
    check_bounds(xp, lengths, limit, f"{kind} lengths", length_name, what=kind)


def check_bounds(xp: Any, a: Any, limit: int, name: str, limit_name: str,
                 what: str | None = None) -> None:
    """Values of ``a`` must lie in ``[0, limit]``, checked wherever they can be read."""
    if math.prod(a.shape) == 0 or not values_readable(a):
        return
    try:
        bad = bool(xp.any(xp.logical_or(a < 0, a > limit)))
    except Exception:  # values that exist only while tracing, under a transformation
        return           # not recognised above: they cannot be read, as documented
    if bad:
        low, high = int(xp.min(a)), int(xp.max(a))
        msg = (f"{name} must lie in [0, {limit_name}={limit}]; "
               f"got {what or name} with min={low}, max={high}")
        raise ValueError(msg)


def check_integer_array(xp: Any, a: Any, name: str, shape: tuple[int, ...]) -> Any:
    """``a`` checked to be integral with ``shape``; returned in a signed dtype."""
    if not xp.isdtype(a.dtype, "integral"):
        msg = f"{name} must have an integer dtype; got {name}.dtype={dtype_name(a.dtype)}"
        raise TypeError(msg)
    if tuple(a.shape) != tuple(shape):
        msg = f"{name} must have shape {tuple(shape)}; got {name}.shape={tuple(a.shape)}"
        raise ValueError(msg)
    return signed(xp, a)


def array_argument(value: Any, kind: str, what: str, name: str | None = None) -> Any:
    """A constructor's array argument: an array of any library as it is, or Python
    integers and booleans (a number or nested sequences) as a NumPy array.

    Checked before any binding; dtype, shape and values are checked when the mask
    meets a call, which also moves the array to the call's library and device.

    Raises:
        TypeError: ``value`` is neither an array nor Python integers or booleans.
    """
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return value
    if _python_integers(value):
        import numpy as np

        return np.asarray(value)
    got = type(value).__name__ if name is None else f"{name} of type {type(value).__name__}"
    msg = f"{kind} expects {what} (an array, or Python integers); got {got}"
    raise TypeError(msg)


def _python_integers(value: Any) -> bool:
    """Whether ``value`` is a Python int or bool, or a non-empty nest of lists and tuples
    of them (an empty list says nothing of its dtype)."""
    if isinstance(value, int):
        return True
    if not isinstance(value, (list, tuple)) or not value:
        return False
    return all(_python_integers(v) if isinstance(v, (list, tuple)) else isinstance(v, int)
               for v in value)


CONTENT_BYTES = 1 << 20
"""The most bytes of arrays a mask's content key reads (see :func:`content_of`)."""


def content_of(arrays: tuple[Any, ...]) -> Content | None:
    """What ``arrays`` hold, as a hashable :class:`Content`; None when some values
    cannot be read now, or they hold more than :data:`CONTENT_BYTES` (a long dense
    mask: cheaper built again than compared)."""
    from array_api_compat import array_namespace

    if sum(math.prod(a.shape) * _itemsize(a) for a in arrays) > CONTENT_BYTES:
        return None
    found = []
    for a in arrays:
        host = host_copy(a)
        if host is None:
            return None
        found.append((namespace_name(array_namespace(a)), device_text(a), host))
    return Content(tuple(found))


class Content:
    """Arrays' values as a dictionary key: equal when each array has the same library,
    device, shape and values (compared in full); hashed from a cheap summary, so a key
    costs a pass over the values, not a hash of their bytes. Holds the host copies:
    take it from a bound mask, whose arrays no caller can write."""

    __slots__ = ("_hash", "arrays")

    def __init__(self, arrays: tuple[tuple[str, str | None, Any], ...]) -> None:
        self.arrays = arrays
        self._hash = hash(tuple((library, device, host.shape, _summary(host))
                                for library, device, host in arrays))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Content) or other._hash != self._hash:
            return False
        import numpy as np

        return all(a[:2] == b[:2] and a[2].shape == b[2].shape
                   and np.array_equal(a[2], b[2])
                   for a, b in zip(self.arrays, other.arrays, strict=True))


def _summary(host: Any) -> Any:
    """A number that equal arrays share (NaN-free integers and booleans in practice)."""
    if host.dtype.kind in "biu":
        return int(host.sum(dtype="int64"))
    return float(host.sum()) if host.dtype.kind == "f" else host.size


def _itemsize(a: Any) -> int:
    dtype = a.dtype
    size = getattr(dtype, "itemsize", None)
    return size if isinstance(size, int) else 8


