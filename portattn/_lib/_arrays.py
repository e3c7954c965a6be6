"""Arrays of any library: their library's short name, dtype and device kind as text,
copies on the host and in another library or device, byte order, and the check that
an array sits where a call runs. Detected through array-api-compat, never imported.
"""

from __future__ import annotations

import sys
from typing import Any

from ._probes import values_readable

__all__ = ["check_beside", "device_class", "device_kind", "device_text", "dtype_name", "host_copy",
           "host_values", "in_native_order", "is_native", "namespace_name", "own_copy"]


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


def host_values(a: Any) -> Any:
    """The values of a small array (lengths, tables) as a NumPy array, computing a lazy
    Dask array; None for values that cannot be read now (traced by JAX or torch)."""
    from array_api_compat import is_dask_array

    return host_copy(a.compute() if is_dask_array(a) else a)


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
    moved = a if device is None or device_text(a) == str(device) else _to_device(a, device)
    if moved is not a or not is_writeable_array(a):
        return moved
    return xp.asarray(a, copy=True)


def _device_of(a: Any) -> Any:
    from array_api_compat import device

    try:
        return device(a)
    except Exception:  # a tracer that carries no device while being traced
        return None


def device_text(a: Any) -> str | None:
    """``str`` of ``a``'s device, or None for an array that reports none."""
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


_device_classes: dict[str, str] = {}


def device_class(dev: Any) -> str:
    """The class of device that speed measurements hold for: ``"cpu"``, or a GPU's kind
    and generation (``"cuda sm_90"``); the kind alone when the generation cannot be
    asked (``"cuda"``). Asked of the device's own library, once per device."""
    kind = device_kind(dev)
    if kind == "cpu":
        return kind
    key = f"{type(dev).__module__}.{type(dev).__name__}:{dev}"
    found = _device_classes.get(key)
    if found is None:
        capability = _capability(dev)
        found = _device_classes[key] = kind if capability is None else f"{kind} sm_{capability}"
    return found


def _capability(dev: Any) -> str | None:
    """A CUDA device's compute capability as ``"90"``, None when it cannot be asked."""
    try:
        torch = sys.modules.get("torch")  # a torch device: torch is imported
        if torch is not None and isinstance(dev, torch.device):
            major, minor = torch.cuda.get_device_capability(dev)
            return f"{major}{minor}"
        found = getattr(dev, "compute_capability", None)  # CuPy's Device, JAX's GPU device
        if found is not None:
            return str(found).replace(".", "")
    except Exception:  # no driver, a device of another process: the kind alone
        return None
    return None


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


# Caches keyed by (type, dtype): a lookup compares keys of equal hash, and
# array-api-strict warns when its dtypes are compared with NumPy's.
_dtype_names: dict[tuple[type, Any], str] = {}


def dtype_name(dtype: Any) -> str:
    """``float32`` for numpy, torch, jax and array-api-strict dtypes alike."""
    key = (type(dtype), dtype)
    name = _dtype_names.get(key)
    if name is None:
        name = getattr(dtype, "name", None)  # NumPy dtypes: also byte-swapped ones (">f4")
        name = name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]
        _dtype_names[key] = name
    return name


def is_native(a: Any) -> bool:
    """Whether ``a``'s bytes are in the machine's order (only NumPy dtypes can say no)."""
    return getattr(a.dtype, "isnative", True)


def in_native_order(xp: Any, a: Any) -> Any:
    """``a``, or a copy in the machine's byte order (a big-endian NumPy array): kernels
    compute and return native dtypes, and compiled loops take nothing else."""
    if is_native(a):
        return a
    # The dtype's own native twin: a namespace may lack the name (float16 is no Array
    # API dtype, and array-api-compat's Dask namespace has none).
    return xp.astype(a, a.dtype.newbyteorder("="))
