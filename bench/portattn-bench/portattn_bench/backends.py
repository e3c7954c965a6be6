"""The array libraries the benchmark puts inputs on: the test suite's backends.

The list and the conversions come from :mod:`portattn.testing` (one list for tests and
benchmarks); this module adds what only timing needs: how to block until a (possibly
asynchronous or lazy) result is ready, which way of measuring peak memory fits, and the
chunking Dask inputs get. Libraries are imported only when a backend is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from portattn.testing import get_backend

if TYPE_CHECKING:
    from collections.abc import Callable

    from portattn.testing import Backend

__all__ = ["BENCH_BACKENDS", "BenchBackend", "default_backends", "get", "unavailable_reason"]


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


def _keep(x: Any) -> Any:
    return x


def _per_head_chunks(x: Any) -> Any:
    # One chunk per (batch, head): the natural unit of parallel work.
    return x.rechunk((*(1 for _ in x.shape[:-2]), -1, -1))


@dataclass(frozen=True)
class BenchBackend:
    """A test backend (by its :data:`portattn.testing.BACKEND_NAMES` name) as timed."""

    name: str
    device: str
    """``cpu`` or ``cuda``: which ``--device`` sweeps it."""
    memory: str | None
    """How peak memory is measured: ``tracemalloc``, ``rss``, ``cuda`` or None."""
    _sync: Callable[[Any], Any]
    _layout: Callable[[Any], Any] = _keep

    @property
    def library(self) -> Backend:
        """The :class:`portattn.testing.Backend` (imports the library)."""
        return get_backend(self.name)

    def asarray(self, x: Any, dtype: str) -> Any:
        """``x`` (a float32 NumPy array) as an array of this backend in ``dtype``."""
        return self._layout(self.library.asarray(x, dtype))

    def wait(self, out: Any) -> Any:
        """Block until ``out`` is computed (async devices, lazy graphs)."""
        return self._sync(out)

    def dtype_reason(self, dtype: str) -> str | None:
        """None when this backend can hold ``dtype``, else why not."""
        dtypes = self.library.dtypes
        if dtype not in dtypes:
            return f"dtype={dtype} (backend {self} supports: {', '.join(sorted(dtypes))})"
        return None

    def __str__(self) -> str:
        return self.name


#: Every backend of :mod:`portattn.testing`, with how it is timed.
BENCH_BACKENDS: dict[str, BenchBackend] = {b.name: b for b in (
    BenchBackend("numpy", "cpu", "tracemalloc", _no_wait),
    BenchBackend("array_api_strict", "cpu", "tracemalloc", _no_wait),
    BenchBackend("torch", "cpu", "rss", _no_wait),
    BenchBackend("jax", "cpu", "rss", _jax_wait),
    BenchBackend("dask", "cpu", "tracemalloc", _dask_wait, _per_head_chunks),
    BenchBackend("cupy", "cuda", None, _cupy_wait),
    BenchBackend("torch_cuda", "cuda", "cuda", _torch_wait),
    BenchBackend("jax_cuda", "cuda", None, _jax_wait),
)}

#: Backends swept when ``--backends`` is not given (array_api_strict is NumPy with
#: checks, so it is only measured on request).
DEFAULT_BACKENDS = ("numpy", "torch", "jax", "dask", "torch_cuda", "jax_cuda", "cupy")


def default_backends(device: str) -> tuple[str, ...]:
    return tuple(n for n in DEFAULT_BACKENDS if BENCH_BACKENDS[n].device == device)


def get(name: str, device: str) -> BenchBackend:
    backend = BENCH_BACKENDS.get(name)
    if backend is None or backend.device != device:
        known = ", ".join(n for n, b in BENCH_BACKENDS.items() if b.device == device)
        msg = f"--backends names unknown backend {name!r} for device={device}; known: {known}"
        raise ValueError(msg)
    return backend


@cache
def unavailable_reason(name: str, device: str) -> str | None:
    """None when the backend can be used here, else why not (imports the library)."""
    try:
        get_backend(get(name, device).name)
    except ImportError as e:
        return str(e) or f"{type(e).__name__} importing {name}"
    return None
