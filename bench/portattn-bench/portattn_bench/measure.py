"""Timing one call, and its peak memory, the way each backend allows.

Time: warm-up calls (compilation, caches) first, then up to ``repeat`` timed calls,
stopping early once a case has used its time budget. Memory: extra bytes at the peak
of one call over what was allocated before it:

- ``tracemalloc`` (NumPy, array-api-strict, Dask on NumPy): NumPy reports its buffers
  to tracemalloc; traced in a separate call because tracing slows Python down.
- ``cuda`` (torch on CUDA): ``torch.cuda.max_memory_allocated`` over the timed calls.
- ``rss`` (every CPU backend; Linux): growth of the resident set over the timed calls,
  after handing freed heap pages back and resetting the high-water mark. Coarser (it
  sees allocator caches), but it sees every library; for NumPy backends the larger of
  the two figures is kept.
"""

from __future__ import annotations

import contextlib
import time
import tracemalloc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Measurement", "measure", "peak_memory"]


@dataclass
class Measurement:
    times: list[float]
    memory: int | None
    memory_method: str | None


#: Most calls timed to fill ``min_time`` (the JSON keeps every time).
MAX_SAMPLES = 50


def measure(call: Callable[[], Any], wait: Callable[[Any], Any], *, repeat: int, warmup: int,
            budget: float, max_time: float, memory: str | None,
            first_of_series: bool = False, settle: float = 0.0,
            min_time: float = 0.0) -> Measurement:
    """Time ``wait(call())`` and measure its peak memory with the method named.

    At least one call after the warm-up is timed (the warm-up may include compilation),
    unless a warm-up call alone took over ``max_time``: then it is the only sample. In
    the first case of a series (``first_of_series``) such a call is followed by one
    more before that is decided, since the first may have compiled the kernel: a cold
    Numba cache made numpy_fast's first call take 10-13 s, and its next 4 ms.

    ``settle`` seconds of idling come first, and calls go on being timed (up to
    :data:`MAX_SAMPLES`) until ``min_time`` seconds were spent: for a rate that other
    work can only slow down (the sgemm reference), the best of many calls is the rate.
    """
    if settle:
        # Worker threads of the library timed before (OpenMP, XLA, BLAS pools) spin a
        # while after their last task, taking cores from this call's threads.
        time.sleep(settle)
    warm = 0.0
    for _ in range(warmup):
        warm = _timed(call, wait)
    if warmup and warm > max_time and first_of_series:
        warm = _timed(call, wait)
    if warm > max_time:
        return Measurement([warm], *_with_traced(None, call, wait, memory))
    start = time.perf_counter()
    times: list[float] = []
    peak = _PeakMemory("cuda" if memory == "cuda" else "rss" if memory else None)
    with peak:
        while not times or _more(times, repeat, time.perf_counter() - start, budget, min_time):
            times.append(_timed(call, wait))
    return Measurement(times, *_with_traced(peak, call, wait, memory))


def _more(times: list[float], repeat: int, spent: float, budget: float,
          min_time: float) -> bool:
    """Whether to time another call: ``repeat`` calls within ``budget`` seconds, and
    more while under ``min_time`` seconds (and :data:`MAX_SAMPLES` calls)."""
    if spent >= budget:
        return False
    return len(times) < repeat or (spent < min_time and len(times) < MAX_SAMPLES)


def peak_memory(call: Callable[[], Any], wait: Callable[[Any], Any], memory: str | None
                ) -> tuple[int | None, str | None]:
    """Peak extra bytes of one call, and the method; ``(None, None)`` when unmeasurable."""
    peak = _PeakMemory("cuda" if memory == "cuda" else "rss" if memory else None)
    with peak:
        wait(call())
    return _with_traced(peak, call, wait, memory)


def _with_traced(peak: _PeakMemory | None, call: Callable[[], Any], wait: Callable[[Any], Any],
                 memory: str | None) -> tuple[int | None, str | None]:
    found = [(peak.bytes, peak.method)] if peak is not None and peak.bytes is not None else []
    if memory == "tracemalloc":
        found.append((_traced_peak(call, wait), "tracemalloc"))
    # A NumPy call may hand its work to another library (say, torch through DLPack),
    # whose buffers tracemalloc never sees: the larger figure is the honest one.
    return max(found, key=lambda f: f[0] or 0, default=(None, None))


def _timed(call: Callable[[], Any], wait: Callable[[Any], Any]) -> float:
    t0 = time.perf_counter()
    wait(call())
    return time.perf_counter() - t0


def _traced_peak(call: Callable[[], Any], wait: Callable[[Any], Any]) -> int:
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    try:
        wait(call())
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        if not was_tracing:
            tracemalloc.stop()


class _PeakMemory(contextlib.AbstractContextManager):
    """Peak extra bytes within the block (``cuda`` or ``rss``); None when unmeasurable."""

    def __init__(self, method: str | None) -> None:
        self.method = method
        self.bytes: int | None = None
        self._before = 0

    def __enter__(self) -> _PeakMemory:
        if self.method == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._before = torch.cuda.memory_allocated()
        elif self.method == "rss":
            _trim_heap()
            self._before = _reset_rss_peak()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return
        if self.method == "cuda":
            import torch

            self.bytes = torch.cuda.max_memory_allocated() - self._before
        elif self.method == "rss" and self._before:
            self.bytes = max(0, _status_kib("VmHWM") * 1024 - self._before)


def _status_kib(field: str) -> int:
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc), so the next peak is seen as growth."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


def _reset_rss_peak() -> int:
    """Reset the resident-set high-water mark (Linux); the current RSS, 0 if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return 0
    return _status_kib("VmRSS") * 1024
