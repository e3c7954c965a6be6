"""How many threads the kernel uses, and the pool that runs them.

The count comes from, in order: :func:`set_num_threads`, the environment variable
``PORTATTN_NUMPY_THREADS``, the CPUs this process may run on. While the pool works,
BLAS is held to one thread per call: our threads already cover the cores, and
nested BLAS threads would only fight them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["THREADS_ENV", "blas_library_paths", "get_num_threads", "run_parallel",
           "set_num_threads"]

THREADS_ENV = "PORTATTN_NUMPY_THREADS"

_configured: int | None = None
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_lock = threading.Lock()
_blas: Any = None


def _check_count(value: Any, what: str) -> int:
    try:
        count = int(value) if not isinstance(value, (bool, float)) else None
    except (TypeError, ValueError):
        count = None
    if count is None or count < 1:
        msg = f"{what} must be a positive integer; got {what}={value!r}"
        raise ValueError(msg)
    return count


def set_num_threads(count: int | None) -> None:
    """Use ``count`` threads from now on; ``None`` goes back to the environment/default."""
    global _configured
    _configured = None if count is None else _check_count(count, "count")


def _machine_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def get_num_threads() -> int:
    """The number of threads the next call will use."""
    if _configured is not None:
        return _configured
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        return _check_count(value, THREADS_ENV)
    return _machine_threads()


def _executor(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != size:
            # The old pool is not shut down: a call in another thread may be about to
            # submit to it. Its threads end once nothing refers to it.
            _pool = ThreadPoolExecutor(size, thread_name_prefix="portattn-numpy")
            _pool_size = size
        return _pool


def _forget_pool() -> None:
    global _pool, _pool_size, _lock, _holders
    # A forked child has none of the parent's threads, nor their calls or their lock.
    _pool, _pool_size, _lock, _holders = None, 0, threading.Lock(), 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _blas_libraries() -> list[Any]:
    global _blas
    if _blas is None:
        from threadpoolctl import ThreadpoolController

        # inspecting the loaded libraries is slow: once
        _blas = ThreadpoolController().select(user_api="blas").lib_controllers
    return _blas


def blas_library_paths() -> list[str]:
    """The files of the BLAS libraries held to one thread while the pool works."""
    return [library.filepath for library in _blas_libraries()]


_holders = 0
"""Calls inside :func:`_blas_single_threaded` now, in any thread."""
_blas_before: list[int] = []


@contextlib.contextmanager
def _blas_single_threaded() -> Iterator[None]:
    """BLAS on one thread within the block (setting the loaded libraries directly, a
    fraction of what threadpoolctl's own ``limit`` costs a call).

    The setting is the process's, so concurrent calls share one hold: the first sets
    it, the last restores it. (Each call restoring its own would let another call's
    products run on several BLAS threads, whose sums round differently.)
    """
    global _holders, _blas_before
    libraries = _blas_libraries()
    with _lock:
        if _holders == 0:
            _blas_before = [library.num_threads for library in libraries]
            for library, count in zip(libraries, _blas_before, strict=True):
                if count != 1:
                    _set_blas_threads(library, 1)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                for library, count in zip(libraries, _blas_before, strict=True):
                    if count != 1:
                        _set_blas_threads(library, count)


def _set_blas_threads(library: Any, count: int) -> None:
    # threadpoolctl 3.8+ lets one thread set OpenBLAS's (process-wide) count and
    # ignores the others: calls from other threads would run BLAS on every core.
    clear = getattr(library, "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)
    library.set_num_threads(count)


def run_parallel(worker: Callable[[Iterator[Any]], None], units: list[Any],
                 threads: int) -> None:
    """Run ``worker`` on ``threads`` threads (the caller and ``threads - 1`` from the pool);
    each pulls units from one shared queue.

    A worker allocates its scratch once and then takes units until none are left, so
    uneven units (causal rows) balance themselves.
    """
    used = max(1, min(threads, len(units)))
    with _blas_single_threaded():
        if used == 1:
            worker(iter(units))
            return
        queue = _SharedIterator(units)
        pool = _executor(threads - 1)
        futures = [pool.submit(_drain, worker, queue) for _ in range(used - 1)]
        try:
            _drain(worker, queue)  # the caller works too instead of waiting
        finally:
            for future in futures:
                if not future.cancel():  # a helper that never started has nothing to do
                    future.result()  # re-raises a worker's exception here


def _drain(worker: Callable[[Iterator[Any]], None], queue: _SharedIterator) -> None:
    try:
        worker(queue)
    except BaseException:
        queue.stop()  # the others stop taking units; the caller sees this exception
        raise


class _SharedIterator:
    """An iterator several threads can pull from."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items
        self._next = 0
        self._lock = threading.Lock()

    def __iter__(self) -> _SharedIterator:
        return self

    def stop(self) -> None:
        with self._lock:
            self._next = len(self._items)

    def __next__(self) -> Any:
        with self._lock:
            i = self._next
            self._next += 1
        if i >= len(self._items):
            raise StopIteration
        return self._items[i]
