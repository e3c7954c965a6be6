"""Reading the values masks hold: integer arrays checked wherever they can be read,
kept in signed dtypes (arithmetic on unsigned lengths would wrap around), and copied
to the host once so a block form can follow them.

Values cannot be read while JAX traces, inside torch.compile, or from a lazy Dask
graph; there the masks keep no copy and the kernels visit every tile the structure
alone does not rule out, which stays correct. Reading an array on an accelerator waits
for it. A leaf module: it imports nothing else of portattn.
"""

from __future__ import annotations

import math
import sys
from typing import Any

__all__ = ["CONTENT_BYTES", "Content", "array_argument", "check_beside", "check_bounds",
           "check_integer_array", "check_range", "content_of", "device_kind", "dtype_text",
           "host_copy", "jax_tracer_type", "namespace_name", "own_copy", "signed",
           "torch_compiling", "values_readable"]


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
        >>> from portattn import masks
        >>> masks.signed(np, np.array([3, 5], dtype=np.uint8)).dtype
        dtype('int32')
        >>> masks.signed(np, np.array([3, 5], dtype=np.int16)).dtype
        dtype('int16')
    """
    if not xp.isdtype(lengths.dtype, "unsigned integer"):
        return lengths
    bits = xp.iinfo(lengths.dtype).bits
    return xp.astype(lengths, xp.int32 if bits <= 16 else xp.int64)


def jax_tracer_type() -> type | None:
    """JAX's tracer class, when JAX is imported; never imports JAX itself.

    Returns:
        ``jax.core.Tracer``, or None when JAX is not imported (``jax.core`` itself
        may not be in ``sys.modules``: recent JAX loads it lazily).

    Example:
        >>> import sys
        >>> from portattn import masks
        >>> masks.jax_tracer_type() is None or "jax" in sys.modules
        True
    """
    import sys

    jax = sys.modules.get("jax")
    core = getattr(jax, "core", None) if jax is not None else None
    return getattr(core, "Tracer", None)


def values_readable(a: Any) -> bool:
    """Whether ``a``'s values can be read now. Reading may still wait for a GPU.

    Args:
        a: an array of any library.

    Returns:
        False for a lazy Dask array, a JAX tracer, or a torch tensor while
        torch.compile traces; True otherwise.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.values_readable(np.arange(3))
        True
    """
    from array_api_compat import is_dask_array

    if is_dask_array(a):
        return False
    tracer = jax_tracer_type()
    if tracer is not None and isinstance(a, tracer):
        return False
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    return not (tensor is not None and isinstance(a, tensor) and torch_compiling())


def torch_compiling() -> bool:
    """Whether torch.compile is tracing now; never imports torch.

    Returns:
        ``torch.compiler.is_compiling()``; False when torch is not imported, or is
        still being imported in another thread (its module then has no
        ``compiler`` yet).

    Example:
        >>> from portattn import masks
        >>> masks.torch_compiling()
        False
    """
    torch = sys.modules.get("torch")
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return is_compiling is not None and bool(is_compiling())


def host_copy(a: Any) -> Any:
    """``a`` as a NumPy array on the host, or None when its values cannot be read now
    (or NumPy is not installed: the block form is then the conservative one)."""
    if not values_readable(a):
        return None
    try:
        import numpy as np
        from array_api_compat import to_device

        try:
            return np.asarray(a)
        except (TypeError, RuntimeError, ValueError):
            return np.asarray(to_device(a, "cpu"))
    except Exception:  # e.g. no NumPy, or a library that cannot hand its values over
        return None


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
        >>> from portattn import masks
        >>> masks.check_range(np, np.array([3, 8]), 8, "key_lengths")
        >>> masks.check_range(np, np.array([3, 9]), 8, "key_lengths")
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
        msg = f"{name} must have an integer dtype; got {name}.dtype={dtype_text(a.dtype)}"
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


def own_copy(xp: Any, a: Any, device: Any = None) -> Any:
    """The call's own copy of a mask's array, in the call's library ``xp`` on ``device``.

    What a bound mask holds, so nothing the caller writes afterwards (in place, through
    a view, DLPack or another library sharing the memory) reaches a block form built
    from it or a backward that reads it. Immutable arrays (JAX) need no copy; arrays of
    another library move through a NumPy copy on the host.
    """
    from array_api_compat import array_namespace, is_writeable_array

    try:
        same = namespace_name(array_namespace(a)) == namespace_name(xp)
    except TypeError:
        same = False
    if not same:
        import numpy as np

        host = host_copy(a)
        if host is None:
            msg = (f"a mask's array of type {type(a).__name__} cannot be read to move it "
                   f"to the query's library ({namespace_name(xp)})")
            raise TypeError(msg)
        return xp.asarray(np.array(host, copy=True), device=device)
    moved = a if device is None or _device_text(a) == str(device) else _to_device(a, device)
    if moved is not a or not is_writeable_array(a):
        return moved
    return xp.asarray(a, copy=True)


def _device_of(a: Any) -> Any:
    from array_api_compat import device

    try:
        return device(a)
    except Exception:  # a tracer that carries no device while being traced
        return None


def _device_text(a: Any) -> str | None:
    found = _device_of(a)
    return None if found is None else str(found)


def _to_device(a: Any, device: Any) -> Any:
    from array_api_compat import to_device

    return to_device(a, device)


_device_kinds: dict[tuple[type, Any], str] = {}


def device_kind(dev: Any) -> str:
    """Normalised device kind: ``cpu``, ``cuda``, ..."""
    key = (type(dev), dev)
    try:
        kind = _device_kinds.get(key)
    except TypeError:  # unhashable: CuPy's Device defines == but no hash
        return _device_kind(dev)
    if kind is None:
        kind = _device_kinds[key] = _device_kind(dev)
    return kind


def _device_kind(dev: Any) -> str:
    kind = getattr(dev, "type", None)  # torch.device
    if isinstance(kind, str):
        return kind
    platform = getattr(dev, "platform", None)  # jax Device
    if isinstance(platform, str):
        return "cuda" if platform == "gpu" else platform
    text = str(dev).lower()
    for known in ("cpu", "cuda", "rocm"):
        if known in text:
            return known
    return text


def check_beside(xp: Any, dev: Any, a: Any, what: str) -> None:
    """``a`` must be an array of the call's library ``xp`` on the kind of device ``dev``.

    Raises:
        TypeError: ``a`` is not an array of that library.
        ValueError: ``a`` is on another kind of device.
    """
    from array_api_compat import array_namespace

    try:
        other = array_namespace(a)
    except TypeError as e:
        msg = f"{what} must be an array of the query's library; got {type(a).__name__}"
        raise TypeError(msg) from e
    if namespace_name(other) != namespace_name(xp):
        msg = (f"{what} must come from the query's library ({namespace_name(xp)}); "
               f"got {namespace_name(other)}")
        raise TypeError(msg)
    a_dev = _device_of(a)
    if a_dev is not None and dev is not None and device_kind(a_dev) != device_kind(dev):
        msg = f"{what} must be on the query's device ({dev}); got {a_dev}"
        raise ValueError(msg)


_namespace_names: dict[str, str] = {}


def namespace_name(xp: Any) -> str:
    """Short library name of an array namespace: numpy, torch, jax, cupy, dask, ..."""
    # keyed by the module's name: torch.compile cannot hash a module
    full = xp.__name__
    name = _namespace_names.get(full)
    if name is None:
        short = full.removeprefix("array_api_compat.")
        name = {"dask.array": "dask", "jax.numpy": "jax"}.get(short, short.split(".")[0])
        _namespace_names[full] = name
    return name


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
        found.append((namespace_name(array_namespace(a)), _device_text(a), host))
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


def dtype_text(dtype: Any) -> str:
    """A dtype's short name, for messages: ``float32`` whatever the library.

    Args:
        dtype: a dtype of any library.

    Returns:
        Its ``name`` when that is a string (NumPy, JAX), else the last dotted part
        of ``str(dtype)`` (``torch.float32`` gives ``float32``).

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.dtype_text(np.dtype("uint8"))
        'uint8'
    """
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]
