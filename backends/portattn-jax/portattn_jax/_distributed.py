"""The JAX engine of :mod:`portattn.distributed`: a mesh axis inside ``shard_map``.

The ``distributed`` engine this plugin adds for JAX (``_library``);
``group`` is the name of the mesh axis the sequence is split along. Inside
``shard_map`` a rank's index is only known on the device, so each step of the schedule
is a ``lax.switch`` over the ranks, each branch running that rank's visible pairs
(portattn's plan, known on the host for every rank). K/V shards move with
``lax.ppermute`` (ring) or ``lax.all_gather``; a ``jax.custom_vjp`` saves only the
shards, the output and the log-sum-exp, and its backward recomputes each pair from
them, sending dK/dV back to their owners (``ppermute``, or ``psum_scatter`` after an
all-gather). The loop over steps is the number of ranks long and unrolled; the tiles
inside each pair are not. ``"ulysses"`` trades sequence shards for head shards with
``lax.all_to_all`` and lets JAX differentiate it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
from jax import lax

from portattn import merge
from portattn.distributed.engine import backward_step, forward, forward_step

from ._flash import varying_like

if TYPE_CHECKING:
    from portattn.distributed.engine import Problem

__all__ = ["all_gather", "attention", "rank_and_size"]


def rank_and_size(group: Any) -> tuple[None, int]:
    """``(None, size)``: the rank along mesh axis ``group`` is known on the device only."""
    if not isinstance(group, str):
        msg = f"group must be the name of a mesh axis inside shard_map; got group={group!r}"
        raise TypeError(msg)
    try:
        size = lax.axis_size(group)
    except NameError as e:
        msg = (f"group={group!r} is not a mesh axis bound here: call "
               "portattn.distributed.attention inside shard_map over that axis")
        raise ValueError(msg) from e
    return None, int(size)


def all_gather(x: Any, group: str) -> list[Any]:
    """Every rank's ``x`` along mesh axis ``group``, in rank order."""
    gathered = lax.all_gather(x, group)
    return [gathered[r] for r in range(gathered.shape[0])]


def attention(problem: Problem, query: Any, key: Any, value: Any, group: str,
              strategy: str) -> tuple[Any, Any]:
    """``(out, lse)`` of this rank's shard, differentiable for query, key, value."""
    if strategy == "ulysses":  # JAX differentiates the all-to-alls and the kernel
        return forward(_AllToAll(group, problem.size), problem, query, key, value, strategy)
    return _build(problem, group, strategy)(query, key, value)


class _AllToAll:
    """The collective ``"ulysses"`` needs, along one mesh axis."""

    def __init__(self, axis: str, size: int) -> None:
        self.axis, self.size = axis, size

    def all_to_all(self, parts: list[Any]) -> list[Any]:
        got = lax.all_to_all(jax.numpy.stack(parts), self.axis, 0, 0)
        return [got[r] for r in range(self.size)]


def _build(problem: Problem, axis: str, strategy: str) -> Any:
    size = problem.size
    ranks = [problem.for_rank(r) for r in range(size)]
    ring = [(i, (i + 1) % size) for i in range(size)]

    def shift(arrays: list[Any]) -> list[Any]:
        return [lax.ppermute(a, axis, ring) for a in arrays]

    def per_rank(step: Any, source_of: Any, *args: Any) -> Any:
        """``step(problem of rank r, source_of(r), *args)`` on rank r."""
        # a rank with no visible pair returns constants: typed as varying, like the rest
        branches = [lambda *a, r=r: varying_like(step(ranks[r], source_of(r), *a), a)
                    for r in range(size)]
        return lax.switch(lax.axis_index(axis), branches, *args)

    def sources(query: Any, key: Any, value: Any) -> Any:
        """``(source_of, key, value)`` per step."""
        if strategy == "all_gather":
            keys, values = lax.all_gather(key, axis), lax.all_gather(value, axis)
            for s in range(size):
                yield (lambda r, s=s: s), keys[s], values[s]
            return
        kv = [key, value]
        for step in range(size):
            yield (lambda r, step=step: (r - step) % size), kv[0], kv[1]
            if step < size - 1:
                kv = shift(kv)

    def run(query: Any, key: Any, value: Any) -> tuple[Any, Any]:
        out = lse = None
        for source_of, k, v in sources(query, key, value):
            o, m = per_rank(forward_step, source_of, query, k, v)
            out, lse = (o, m) if out is None else merge([out, o], [lse, m])
        return out, lse

    @jax.custom_vjp
    def call(query: Any, key: Any, value: Any) -> tuple[Any, Any]:
        return run(query, key, value)

    def call_fwd(query: Any, key: Any, value: Any) -> Any:
        out, lse = run(query, key, value)
        return (out, lse), (query, key, value, out, lse)

    def call_bwd(saved: Any, cotangents: Any) -> tuple[Any, Any, Any]:
        query, key, value, out, lse = saved
        dout, dlse = cotangents
        dq = None
        if strategy == "all_gather":
            dks, dvs = [], []
            for source_of, k, v in sources(query, key, value):
                gq, gk, gv = per_rank(backward_step, source_of, query, k, v, out, lse,
                                      dout, dlse)
                dq = gq if dq is None else dq + gq
                dks.append(gk)
                dvs.append(gv)
            dk = lax.psum_scatter(jax.numpy.stack(dks), axis, scatter_dimension=0)
            dv = lax.psum_scatter(jax.numpy.stack(dvs), axis, scatter_dimension=0)
        else:
            carried = None
            for source_of, k, v in sources(query, key, value):
                gq, gk, gv = per_rank(backward_step, source_of, query, k, v, out, lse,
                                      dout, dlse)
                dq = gq if dq is None else dq + gq
                if carried is not None:
                    gk, gv = gk + carried[0], gv + carried[1]
                carried = [gk, gv] if size == 1 else shift([gk, gv])
            dk, dv = carried
        return (dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype))

    call.defvjp(call_fwd, call_bwd)
    return call
