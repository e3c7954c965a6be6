"""The strategies, written once against a :class:`Communicator` (an engine's
collectives), so every engine runs the same schedule.

- ``"ring"``: K/V shards travel rank to rank (``size - 1`` shifts, each started before
  the current block's compute so the two overlap), in :data:`PIECES` pieces of rows
  that each shift alone. The backward sends K/V round again and the dK/dV accumulators
  of each piece after it (``size`` shifts: they end at their owner).
- ``"all_gather"``: every rank gathers every K/V shard at once (one collective; memory
  for the whole K/V), and the backward reduce-scatters dK/dV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ._compute import Partials, add_pair_grads, compute_dtype, zeros_like_shard
from ._plan import pieces
from ._ulysses import ulysses

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._plan import Problem

__all__ = ["STRATEGIES", "Communicator", "backward", "forward"]

STRATEGIES = ("ring", "all_gather", "ulysses")

PIECES = 4
"""The ring moves each K/V shard as this many pieces of rows, each sent on before its
compute: besides its own shards a rank then holds ``1 + 1 / PIECES`` K/V shards (the
piece in use, those waiting for their turn, the one arriving) instead of two."""


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
        spans = pieces(key.shape[-2], PIECES)
        held = _pieces_of(key, value, spans)
        for step in range(size):
            for i, rows in enumerate(spans):
                kv = held[i]
                pending = comm.start_shift(kv) if step < size - 1 else None
                for pair in problem.pairs((rank - step) % size, rows=rows):
                    partials.add(pair, *kv)
                # piece i of the next step's shard (the handle keeps the sent one alive)
                held[i] = None if pending is None else comm.finish_shift(pending)
                del kv, pending
    return partials.result(value.shape[-1])


def _pieces_of(key: Any, value: Any, spans: list[tuple[int, int]]) -> list[Any]:
    return [[key[..., a:b, :], value[..., a:b, :]] for a, b in spans]


def backward(comm: Communicator, problem: Problem, query: Any, key: Any, value: Any,
             out: Any, lse: Any, dout: Any, dlse: Any,
             strategy: str) -> tuple[Any, Any, Any]:
    """Gradients of this rank's query, key and value shards, each in its dtype.

    Every visible pair adds its gradients into accumulators (in place where the library
    allows). The ring works piece by piece: each piece's K/V shift overlaps its compute,
    and its dK/dV pair is shifted on right after it, the previous rank's arriving in
    exchange; so a rank holds its shards, the output, dQ, ``1 + 1 / PIECES`` K/V shards
    and one shard's worth of dK/dV pieces.
    """
    if strategy == "ulysses":
        msg = ("strategy='ulysses' has no backward of its own: its gradients come from "
               "the library's autograd through the all-to-alls")
        raise ValueError(msg)
    xp, size, rank = problem.xp, problem.size, problem.rank
    ct = compute_dtype(xp, query.dtype)
    dq = zeros_like_shard(xp, query, ct)

    def visit(source: int, rows: tuple[int, int] | None, k: Any, v: Any, dk: Any,
              dv: Any) -> tuple[Any, Any]:
        nonlocal dq
        grads = (dq, dk, dv)
        for pair in problem.pairs(source, rows=rows):
            grads = add_pair_grads(problem, pair, query, k, v, out, lse, dout, dlse, grads)
        dq = grads[0]
        return grads[1], grads[2]

    if strategy == "all_gather":
        keys, values = comm.all_gather(key), comm.all_gather(value)
        dks, dvs = [], []
        for source in range(size):
            dk, dv = visit(source, None, keys[source], values[source],
                           zeros_like_shard(xp, key, ct), zeros_like_shard(xp, value, ct))
            dks.append(dk)
            dvs.append(dv)
        dkey, dvalue = comm.reduce_scatter(dks), comm.reduce_scatter(dvs)
    else:
        spans = pieces(key.shape[-2], PIECES)
        held = _pieces_of(key, value, spans)
        grads: list[Any] = [None] * len(spans)  # each piece's dK/dV, for its next step
        for step in range(size):
            source = (rank - step) % size
            for i, rows in enumerate(spans):
                kv = held[i]
                dk, dv = grads[i] or [zeros_like_shard(xp, a, ct) for a in kv]
                grads[i] = None
                pending = comm.start_shift(kv) if step < size - 1 else None
                dk, dv = visit(source, rows, *kv, dk, dv)
                held[i] = None if pending is None else comm.finish_shift(pending)
                del kv, pending
                # Sent on at once, and the previous rank's pair for the next step (after
                # the last step: this rank's own) waited for: overlapping this transfer
                # too would hold a second set of pieces in flight.
                grads[i] = [dk, dv] if size == 1 else comm.finish_shift(
                    comm.start_shift([dk, dv]))
                del dk, dv
        dkey, dvalue = (_joined(xp, [g[j] for g in grads]) for j in (0, 1))
    return (xp.astype(dq, query.dtype, copy=False), xp.astype(dkey, key.dtype, copy=False),
            xp.astype(dvalue, value.dtype, copy=False))


def _joined(xp: Any, parts: list[Any]) -> Any:
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=-2)
