"""A group of threads in one process standing in for ranks (tests, examples, and
checking a schedule without a cluster)."""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["LocalGroup", "run_local"]


class _Shared:
    def __init__(self, size: int) -> None:
        self.size = size
        self.mailboxes = [queue.Queue() for _ in range(size)]
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size


class LocalGroup:
    """Rank ``rank`` of ``size`` threads that exchange arrays in memory: a
    :class:`~portattn.distributed.engine.Communicator` for any array library.

    Make them with :func:`run_local`, which runs one function per rank.
    """

    def __init__(self, shared: Any, rank: int) -> None:
        self._shared, self.rank, self.size = shared, rank, shared.size
        self._shifts = 0

    def start_shift(self, arrays: Sequence[Any]) -> Any:
        tag = self._shifts
        self._shifts += 1
        self._shared.mailboxes[(self.rank + 1) % self.size].put((tag, list(arrays)))
        return tag

    def finish_shift(self, handle: Any) -> list[Any]:
        tag, arrays = self._shared.mailboxes[self.rank].get(timeout=120)
        if tag != handle:  # every rank runs the same schedule: shifts arrive in order
            msg = f"rank {self.rank} expected shift {handle} and received shift {tag}"
            raise RuntimeError(msg)
        return arrays

    def all_gather(self, x: Any) -> list[Any]:
        shared = self._shared
        shared.barrier.wait()
        shared.slots[self.rank] = x
        shared.barrier.wait()
        gathered = list(shared.slots)
        shared.barrier.wait()
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


def run_local(fn: Callable[[LocalGroup], Any], size: int) -> list[Any]:
    """Run ``fn(group)`` in ``size`` threads, one per rank; return the results in rank
    order (the first exception raised by any rank is raised again).

    Example:
        >>> from portattn.distributed import run_local
        >>> run_local(lambda group: group.all_gather(group.rank * 10), 3)
        [[0, 10, 20], [0, 10, 20], [0, 10, 20]]
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        msg = f"size must be an int >= 1; got size={size!r}"
        raise ValueError(msg)
    shared = _Shared(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            results[rank] = fn(LocalGroup(shared, rank))
        except BaseException as e:
            errors.append(e)
            shared.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
