"""A group of threads in one process standing in for ranks (tests, examples, and
checking a schedule without a cluster).

Every wait has a timeout, and a rank that fails tells the others at once: they raise
:class:`~portattn.distributed.CollectiveError` at their next wait instead of waiting
for it.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from ._faults import CollectiveError, check_timeout, failure_text, gave_up

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["LocalGroup", "run_local"]

_FAILED = object()
"""Put in every mailbox when a rank fails, to wake the ranks waiting for a shift."""


class _Shared:
    def __init__(self, size: int, timeout: float) -> None:
        self.size, self.timeout = size, timeout
        self.mailboxes = [queue.Queue() for _ in range(size)]
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size
        self.shifts = [0] * size  # shifts each rank started (one count per rank)
        self.failure: str | None = None
        self.lock = threading.Lock()

    def fail(self, rank: int, reason: str) -> None:
        """Rank ``rank`` stopped: every rank's next wait raises, naming the first."""
        with self.lock:
            if self.failure is not None:
                return
            self.failure = f"rank {rank} failed: {reason}"
        self.barrier.abort()
        for box in self.mailboxes:
            box.put(_FAILED)


class LocalGroup:
    """Rank ``rank`` of ``size`` threads that exchange arrays in memory: a
    :class:`~portattn.distributed.engine.Communicator` for any array library.

    Make them with :func:`run_local`, which runs one function per rank. Each wait
    gives up after ``timeout`` seconds (:func:`run_local`'s, or
    :meth:`with_timeout`'s) with :class:`~portattn.distributed.CollectiveError`.
    """

    def __init__(self, shared: Any, rank: int, timeout: float | None = None) -> None:
        self._shared, self.rank, self.size = shared, rank, shared.size
        self.timeout = shared.timeout if timeout is None else timeout

    def with_timeout(self, timeout: float) -> LocalGroup:
        """The same rank of the same group, waiting at most ``timeout`` seconds."""
        return LocalGroup(self._shared, self.rank, check_timeout(timeout))

    def abort(self, reason: str) -> None:
        """This rank failed (``reason``): the others stop waiting for it."""
        self._shared.fail(self.rank, reason)

    def start_shift(self, arrays: Sequence[Any]) -> Any:
        shared = self._shared
        tag = shared.shifts[self.rank]
        shared.shifts[self.rank] += 1
        shared.mailboxes[(self.rank + 1) % self.size].put((tag, list(arrays)))
        return tag

    def finish_shift(self, handle: Any) -> list[Any]:
        where = f"waiting for shift {handle} from rank {(self.rank - 1) % self.size}"
        try:
            got = self._shared.mailboxes[self.rank].get(timeout=self.timeout)
        except queue.Empty:
            raise self._gave_up(where, timed_out=True) from None
        if got is _FAILED:
            raise self._gave_up(where, timed_out=False)
        tag, arrays = got
        if tag != handle:  # every rank runs the same schedule: shifts arrive in order
            msg = f"rank {self.rank} expected shift {handle} and received shift {tag}"
            raise RuntimeError(msg)
        return arrays

    def all_gather(self, x: Any) -> list[Any]:
        shared = self._shared
        self._meet("before an all_gather")
        shared.slots[self.rank] = x
        self._meet("in an all_gather")
        gathered = list(shared.slots)
        self._meet("after an all_gather")
        return gathered

    def all_to_all(self, parts: Sequence[Any]) -> list[Any]:
        every = self.all_gather(list(parts))
        return [every[r][self.rank] for r in range(self.size)]

    def reduce_scatter(self, parts: Sequence[Any]) -> Any:
        every = self.all_gather(list(parts))
        total = every[0][self.rank]
        for other in every[1:]:
            total = total + other[self.rank]
        return total

    def _meet(self, where: str) -> None:
        start = time.monotonic()
        try:
            self._shared.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            timed_out = time.monotonic() - start >= self.timeout
            raise self._gave_up(where, timed_out=timed_out) from None

    def _gave_up(self, where: str, *, timed_out: bool) -> CollectiveError:
        shared = self._shared
        if timed_out:
            why = f"no answer within timeout={self.timeout:g} s"
            shared.fail(self.rank, f"gave up {where}: {why}")  # the others stop too
        else:
            why = shared.failure or "another rank stopped waiting"
        return gave_up(self.rank, self.size, where, why)


def run_local(fn: Callable[[LocalGroup], Any], size: int, *,
              timeout: float = 120.0) -> list[Any]:
    """Run ``fn(group)`` in ``size`` threads, one per rank; return the results in rank
    order.

    A rank that raises stops the others: their next wait raises
    :class:`~portattn.distributed.CollectiveError`. The error raised again here is
    the one that started it (a rank's own error, not the ``CollectiveError`` it
    caused elsewhere).

    Args:
        fn: what each rank runs, given its :class:`LocalGroup`.
        size: the number of ranks, an int >= 1.
        timeout: seconds any wait of a rank (a shift, an all-gather) may last.

    Example:
        >>> from portattn.distributed import run_local
        >>> run_local(lambda group: group.all_gather(group.rank * 10), 3)
        [[0, 10, 20], [0, 10, 20], [0, 10, 20]]
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        msg = f"size must be an int >= 1; got size={size!r}"
        raise ValueError(msg)
    seconds = check_timeout(timeout)
    if seconds is None:
        msg = "run_local needs a timeout in seconds; got timeout=None"
        raise ValueError(msg)
    shared = _Shared(size, seconds)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            results[rank] = fn(LocalGroup(shared, rank))
        except BaseException as e:
            errors.append(e)
            shared.fail(rank, failure_text(e))

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        # the cause first: a rank's own error before the CollectiveErrors it caused
        raise min(errors, key=lambda e: isinstance(e, CollectiveError))
    return results
