"""The array libraries the test suite runs on, behind one small interface."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from array_api_compat import (
    array_namespace,
    is_cupy_array,
    is_dask_array,
    is_torch_array,
)

from .._lib import device_kind, namespace_name

__all__ = ["BACKEND_NAMES", "Backend", "get_backend", "to_numpy"]

ALL_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
NO_BFLOAT = frozenset({"float16", "float32", "float64"})


@dataclass(frozen=True)
class Backend:
    """One array library (on one device) as the tests see it.

    Get one with :func:`get_backend`; the ``backend`` fixture of
    :mod:`portattn.testing.plugin` gives each selected one in turn.

    Attributes:
        name: the backend's name, one of :data:`BACKEND_NAMES`.
        xp: its array namespace (array-api-compat's wrapper where there is one).
        dtypes: the floating dtypes it has, by name.
        device: the device its arrays are made on; None for the library's default.

    Example:
        >>> from portattn.testing import get_backend
        >>> backend = get_backend("numpy")
        >>> backend.name, backend.namespace, backend.device_kind
        ('numpy', 'numpy', 'cpu')
        >>> backend.asarray([[1.0, 2.0]], "float32").dtype
        dtype('float32')
    """

    name: str
    xp: Any
    dtypes: frozenset[str]
    _make: Callable[[Any, str | None], Any] = field(repr=False)
    device: Any = None

    @property
    def namespace(self) -> str:
        """The namespace's name as kernels declare it (``"numpy"``, ``"torch"``, ...)."""
        return namespace_name(self.xp)

    @property
    def device_kind(self) -> str:
        """The device's kind as kernels declare it (``"cpu"``, ``"cuda"``, ...)."""
        return "cpu" if self.device is None else device_kind(self.device)

    def asarray(self, array: Any, dtype: str | None = None) -> Any:
        """A NumPy array as this backend's array.

        Args:
            array: a NumPy array (or anything ``numpy.asarray`` takes).
            dtype: a dtype name to cast to (``"bfloat16"`` where the library has it);
                None keeps the array's.

        Returns:
            The array in this backend's library, on its device.
        """
        return self._make(array, dtype)

    def to_numpy(self, x: Any) -> Any:
        """:func:`to_numpy` of ``x``."""
        return to_numpy(x)


def to_numpy(x: Any) -> Any:
    """Any supported array as a NumPy array.

    Dask arrays are computed, torch tensors detached and moved to the host (bfloat16
    widened to float32), CuPy arrays copied to the host.

    Args:
        x: an array of NumPy, torch, JAX, CuPy, Dask or array-api-strict.

    Returns:
        A NumPy array.

    Example:
        >>> import torch
        >>> from portattn.testing import to_numpy
        >>> to_numpy(torch.ones(2, dtype=torch.bfloat16))
        array([1., 1.], dtype=float32)
    """
    import numpy as np

    if is_dask_array(x):
        x = x.compute()
    if is_torch_array(x):
        import torch

        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    if is_cupy_array(x):
        return x.get()
    if type(x).__module__.startswith("array_api_strict"):
        return np.from_dlpack(x)
    return np.asarray(x)


def _numpy() -> Backend:
    import numpy as np

    def make(a, dtype):
        return np.asarray(a, dtype=dtype) if dtype else np.asarray(a)

    return Backend("numpy", array_namespace(np.empty(0)), NO_BFLOAT, make)


def _strict() -> Backend:
    import array_api_strict as xp

    def make(a, dtype):
        return xp.asarray(a, dtype=getattr(xp, dtype) if dtype else None)

    return Backend("array_api_strict", xp, frozenset({"float32", "float64"}), make)


def _torch(device: str) -> Backend:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        msg = "torch has no CUDA device"
        raise ImportError(msg)

    def make(a, dtype):
        t = torch.asarray(a, device=device)
        return t.to(getattr(torch, dtype)) if dtype else t

    dev = torch.device(device)
    return Backend("torch" if device == "cpu" else "torch_cuda",
                   array_namespace(torch.empty(0)), ALL_FLOATS, make, dev)


def _jax(platform: str) -> Backend:
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 must stay float64
    import jax.numpy as jnp

    try:
        dev = jax.devices(platform)[0]
    except RuntimeError as e:  # no such platform in this jaxlib
        msg = f"jax has no {platform} device"
        raise ImportError(msg) from e

    # On CPU the arrays stay uncommitted (JAX's default placement), as a user makes them.
    placed = None if platform == "cpu" else dev

    def make(a, dtype):
        return jnp.asarray(a, dtype=getattr(jnp, dtype) if dtype else None, device=placed)

    if platform == "cpu":
        return Backend("jax", jnp, ALL_FLOATS, make)
    return Backend("jax_cuda", jnp, ALL_FLOATS, make, dev)


def _dask() -> Backend:
    import dask.array as da
    import numpy as np

    def make(a, dtype):
        a = np.asarray(a, dtype=dtype) if dtype else np.asarray(a)
        # dask's automatic chunking divides by zero on zero-size arrays
        return da.from_array(a, chunks=-1 if a.size == 0 else "auto")

    return Backend("dask", array_namespace(da.empty(0)), NO_BFLOAT, make)


def _cupy() -> Backend:
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # the CUDA driver is missing altogether
        msg = f"cupy has no CUDA device: {e}"
        raise ImportError(msg) from e
    if not count:
        msg = "cupy has no CUDA device"
        raise ImportError(msg)

    def make(a, dtype):
        return cupy.asarray(a, dtype=dtype) if dtype else cupy.asarray(a)

    return Backend("cupy", array_namespace(cupy.empty(0)), NO_BFLOAT, make,
                   cupy.cuda.Device(0))


_LOADERS: dict[str, Callable[[], Backend]] = {
    "numpy": _numpy,
    "array_api_strict": _strict,
    "torch": lambda: _torch("cpu"),
    "jax": lambda: _jax("cpu"),
    "dask": _dask,
    "cupy": _cupy,
    "torch_cuda": lambda: _torch("cuda"),
    "jax_cuda": lambda: _jax("gpu"),
}
BACKEND_NAMES = tuple(_LOADERS)
_loaded: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The named test backend, loaded once and kept.

    Args:
        name: one of :data:`BACKEND_NAMES`.

    Returns:
        The :class:`Backend`.

    Raises:
        ValueError: an unknown name.
        ImportError: its library or device is missing here.

    Example:
        >>> from portattn.testing import get_backend
        >>> get_backend("numpy").name
        'numpy'
        >>> try:
        ...     get_backend("numpy_gpu")
        ... except ValueError as e:
        ...     print(str(e).split(";")[0])
        unknown test backend 'numpy_gpu'
    """
    if name not in _LOADERS:
        msg = f"unknown test backend {name!r}; known: {', '.join(BACKEND_NAMES)}"
        raise ValueError(msg)
    if name not in _loaded:
        _loaded[name] = _LOADERS[name]()
    return _loaded[name]
