"""The strategies, written once against a :class:`Communicator` (an engine's
collectives), so every engine runs the same schedule.

- ``"ring"``: K/V shards travel rank to rank (``size - 1`` shifts, each started before
  the current block's compute so the two overlap). The backward sends K/V round again
  and the dK/dV accumulators after them (``size`` shifts: they end at their owner).
- ``"all_gather"``: every rank gathers every K/V shard at once (one collective; memory
  for the whole K/V), and the backward reduce-scatters dK/dV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ._compute import Partials, add_pair_grads, compute_dtype, zeros_like_shard
from ._ulysses import ulysses

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._plan import Problem

__all__ = ["STRATEGIES", "Communicator", "backward", "forward"]

STRATEGIES = ("ring", "all_gather", "ulysses")


class Communicator(Protocol):
    """The collectives an engine provides, between the ``size`` ranks of a group."""

    rank: int
    size: int

    def start_shift(self, arrays: Sequence[Any]) -> Any:
        """Start sending ``arrays`` to rank ``rank + 1`` and receiving the same shapes
        from ``rank - 1`` (modulo ``size``); return a handle."""

    def finish_shift(self, handle: Any) -> list[Any]:
        """Wait for a shift; return the arrays received."""

    def all_gather(self, x: Any) -> list[Any]:
        """Every rank's ``x``, in rank order."""

    def reduce_scatter(self, parts: Sequence[Any]) -> Any:
        """The sum over ranks of their ``parts[rank]``."""

    def all_to_all(self, parts: Sequence[Any]) -> list[Any]:
        """What every rank sent this one (their ``parts[rank]``), in rank order; for
        ``"ulysses"``, differentiable where the library has autograd."""


def forward(comm: Communicator, problem: Problem, query: Any, key: Any,
            value: Any, strategy: str) -> tuple[Any, Any]:
    """``(out, lse)`` of this rank's query shard over every rank's keys, in the
    compute dtype (float32 for half precision)."""
    if strategy == "ulysses":
        return ulysses(comm, problem, query, key, value)
    partials = Partials(problem, query)
    size, rank = problem.size, problem.rank
    if strategy == "all_gather":
        keys, values = comm.all_gather(key), comm.all_gather(value)
        for source in range(size):
            for pair in problem.pairs(source):
                partials.add(pair, keys[source], values[source])
    else:
        kv = [key, value]
        for step in range(size):
            pending = comm.start_shift(kv) if step < size - 1 else None
            for pair in problem.pairs((rank - step) % size):
                partials.add(pair, *kv)
            if pending is not None:
                kv = comm.finish_shift(pending)
                pending = None  # the handle keeps the shards just used alive
    return partials.result(value.shape[-1])


def backward(comm: Communicator, problem: Problem, query: Any, key: Any, value: Any,
             out: Any, lse: Any, dout: Any, dlse: Any,
             strategy: str) -> tuple[Any, Any, Any]:
    """Gradients of this rank's query, key and value shards, each in its dtype.

    Every visible pair adds its gradients into whole-shard accumulators (in place where
    the library allows). The ring holds one pair of dK/dV accumulators at a time: the
    pair that arrived from the previous rank is waited for before the step's compute
    and shifted on after it (the K/V shift still overlaps the compute), so a rank holds
    its shards, the output, dQ, two K/V shards and one dK/dV pair.
    """
    if strategy == "ulysses":
        msg = ("strategy='ulysses' has no backward of its own: its gradients come from "
               "the library's autograd through the all-to-alls")
        raise ValueError(msg)
    xp, size, rank = problem.xp, problem.size, problem.rank
    ct = compute_dtype(xp, query.dtype)
    dq = zeros_like_shard(xp, query, ct)

    def visit(source: int, k: Any, v: Any, dk: Any, dv: Any) -> tuple[Any, Any]:
        nonlocal dq
        grads = (dq, dk, dv)
        for pair in problem.pairs(source):
            grads = add_pair_grads(problem, pair, query, k, v, out, lse, dout, dlse, grads)
        dq = grads[0]
        return grads[1], grads[2]

    if strategy == "all_gather":
        keys, values = comm.all_gather(key), comm.all_gather(value)
        dks, dvs = [], []
        for source in range(size):
            dk, dv = visit(source, keys[source], values[source],
                           zeros_like_shard(xp, key, ct), zeros_like_shard(xp, value, ct))
            dks.append(dk)
            dvs.append(dv)
        dkey, dvalue = comm.reduce_scatter(dks), comm.reduce_scatter(dvs)
    else:
        kv = [key, value]
        carried = None
        for step in range(size):
            source = (rank - step) % size
            if carried is None:
                dk, dv = zeros_like_shard(xp, key, ct), zeros_like_shard(xp, value, ct)
            else:  # the accumulators of this source, from the previous rank
                dk, dv = comm.finish_shift(carried)
                carried = None  # the handle keeps the sent pair alive
            pending = comm.start_shift(kv) if step < size - 1 else None
            dk, dv = visit(source, *kv, dk, dv)
            if pending is not None:
                kv = comm.finish_shift(pending)
                pending = None
            if size == 1:  # nothing travels: the block is home
                break
            carried = comm.start_shift([dk, dv])
            del dk, dv
        if carried is not None:
            dk, dv = comm.finish_shift(carried)
        dkey, dvalue = dk, dv
    return (xp.astype(dq, query.dtype, copy=False), xp.astype(dkey, key.dtype, copy=False),
            xp.astype(dvalue, value.dtype, copy=False))
