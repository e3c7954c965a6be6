"""Array libraries the benchmark can put inputs on, and how to wait for a result.

Each backend knows how to turn a NumPy array into its own array on a device, how to
block until a (possibly asynchronous or lazy) result is ready, and which way of
measuring peak memory fits it. Libraries are imported only when a backend is used.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["BACKENDS", "BenchBackend", "default_backends", "get", "unavailable_reason"]

CPU_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


@dataclass(frozen=True)
class BenchBackend:
    """One array library on one device kind (``cpu`` or ``cuda``)."""

    name: str
    device: str
    module: str
    dtypes: frozenset[str]
    memory: str | None
    """How peak memory is measured: ``tracemalloc``, ``rss``, ``cuda`` or None."""
    _make: Callable[[Any, str, str], Any]
    _sync: Callable[[Any], Any]

    def asarray(self, x: Any, dtype: str) -> Any:
        """``x`` (a float32 NumPy array) as an array of this backend in ``dtype``."""
        return self._make(x, dtype, self.device)

    def wait(self, out: Any) -> Any:
        """Block until ``out`` is computed (async devices, lazy graphs)."""
        return self._sync(out)

    def dtype_reason(self, dtype: str) -> str | None:
        """None when this backend can hold ``dtype``, else why not."""
        if dtype not in self.dtypes:
            return f"dtype={dtype} (backend {self} supports: {', '.join(sorted(self.dtypes))})"
        if self.name == "jax" and dtype == "float64":
            import jax

            if not jax.config.read("jax_enable_x64"):
                return "dtype=float64 needs jax_enable_x64 (JAX_ENABLE_X64=1)"
        return None

    def __str__(self) -> str:
        return self.name if self.device == "cpu" else f"{self.name}:{self.device}"


def _numpy(x: Any, dtype: str, device: str) -> Any:
    import numpy as np

    return np.ascontiguousarray(x, dtype=dtype)


def _strict(x: Any, dtype: str, device: str) -> Any:
    import array_api_strict as xp

    return xp.asarray(_numpy(x, dtype, device))


def _torch(x: Any, dtype: str, device: str) -> Any:
    import torch

    return torch.from_numpy(x).to(device=device, dtype=getattr(torch, dtype)).contiguous()


def _jax(x: Any, dtype: str, device: str) -> Any:
    import jax
    import jax.numpy as jnp

    target = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    return jax.device_put(jnp.asarray(x, dtype=getattr(jnp, dtype)), target)


def _dask(x: Any, dtype: str, device: str) -> Any:
    import dask.array as da

    # One chunk per (batch, head): the natural unit of parallel work.
    chunks = (*(1 for _ in x.shape[:-2]), -1, -1)
    return da.from_array(_numpy(x, dtype, device), chunks=chunks)


def _cupy(x: Any, dtype: str, device: str) -> Any:
    import cupy

    return cupy.asarray(x, dtype=dtype)


def _no_wait(out: Any) -> Any:
    return out


def _torch_wait(out: Any) -> Any:
    import torch

    torch.cuda.synchronize()
    return out


def _jax_wait(out: Any) -> Any:
    return out.block_until_ready()


def _dask_wait(out: Any) -> Any:
    return out.compute()


def _cupy_wait(out: Any) -> Any:
    import cupy

    cupy.cuda.Device().synchronize()
    return out


_HALF_AND_UP = CPU_DTYPES
BACKENDS: dict[tuple[str, str], BenchBackend] = {
    (b.name, b.device): b for b in (
        BenchBackend("numpy", "cpu", "numpy", CPU_DTYPES - {"bfloat16"}, "tracemalloc",
                     _numpy, _no_wait),
        BenchBackend("array_api_strict", "cpu", "array_api_strict", CPU_DTYPES - {"bfloat16"},
                     "tracemalloc", _strict, _no_wait),
        BenchBackend("torch", "cpu", "torch", _HALF_AND_UP, "rss", _torch, _no_wait),
        BenchBackend("jax", "cpu", "jax", _HALF_AND_UP, "rss", _jax, _jax_wait),
        BenchBackend("dask", "cpu", "dask", CPU_DTYPES - {"bfloat16"}, "tracemalloc",
                     _dask, _dask_wait),
        BenchBackend("torch", "cuda", "torch", _HALF_AND_UP, "cuda", _torch, _torch_wait),
        BenchBackend("jax", "cuda", "jax", _HALF_AND_UP, None, _jax, _jax_wait),
        BenchBackend("cupy", "cuda", "cupy", CPU_DTYPES - {"bfloat16"}, None,
                     _cupy, _cupy_wait),
    )
}

#: Backends swept when ``--backends`` is not given (array_api_strict is NumPy with
#: checks, so it is only measured on request).
DEFAULT_BACKENDS = ("numpy", "torch", "jax", "dask", "cupy")


def default_backends(device: str) -> tuple[str, ...]:
    return tuple(n for n in DEFAULT_BACKENDS if (n, device) in BACKENDS)


def get(name: str, device: str) -> BenchBackend:
    try:
        return BACKENDS[name, device]
    except KeyError:
        known = ", ".join(sorted({n for n, d in BACKENDS if d == device}))
        msg = f"--backends names unknown backend {name!r} for device={device}; known: {known}"
        raise ValueError(msg) from None


@cache
def unavailable_reason(name: str, device: str) -> str | None:
    """None when the backend can be used here, else why not (imports the library)."""
    backend = get(name, device)
    if importlib.util.find_spec(backend.module) is None:
        return f"{backend.module} is not installed"
    if device == "cpu":
        return None
    try:
        found = _cuda_devices(name)
    except Exception as e:
        return f"no CUDA device usable by {name}: {type(e).__name__}: {e}"
    return None if found else f"no CUDA device visible to {name}"


def _cuda_devices(name: str) -> int:
    if name == "torch":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "cupy":
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    if name == "jax":
        import jax

        return len(jax.devices("gpu"))
    return 0
