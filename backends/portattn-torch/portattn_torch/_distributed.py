"""The ``torch.distributed`` engine of :mod:`portattn.distributed`.

Registered under the ``portattn.distributed`` entry point for the ``torch`` namespace.
The schedule (ring or all-gather) and the math are portattn's, portable; this module
supplies the collectives (point-to-point sends for the ring, started before each
block's compute so they overlap with it; ``all_gather`` and ``reduce_scatter``) and the
autograd: the forward saves only the shards, the output and the log-sum-exp, and the
backward recomputes each visible pair from them (FlashAttention-2), sending dK/dV back
to their owners. ``"ulysses"`` trades sequence shards for head shards with
differentiable all-to-alls and lets torch autograd run the kernel's own backward.
Works with any backend torch.distributed has (gloo on CPU, NCCL on CUDA). Under
``torch.compile`` the ring and the all-gather are a graph break
(``torch.compiler.disable``): the model's other parts compile, the call runs eagerly,
and ``fullgraph=True`` raises Dynamo's error with the reason. ``"ulysses"`` is traced
(its all-to-alls are functional collectives), with ``fullgraph=True`` too once portattn
has found its plugins (``portattn.kernels()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from portattn.distributed.engine import backward, forward

if TYPE_CHECKING:
    from collections.abc import Sequence

    from portattn.distributed.engine import Problem

__all__ = ["all_gather", "attention", "rank_and_size"]

_TAGS = 1 << 20


def rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` (None: the default group) and its size."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        msg = f"group must be a torch.distributed ProcessGroup or None; got group={group!r}"
        raise TypeError(msg)
    if not dist.is_available() or not dist.is_initialized():
        msg = ("portattn.distributed.attention on torch tensors needs an initialised "
               "torch.distributed process group (torch.distributed.init_process_group); "
               f"got group={group!r}")
        raise RuntimeError(msg)
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather(x: Any, group: Any) -> list[Any]:
    """Every rank's ``x``, in rank order."""
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out


class Communicator:
    """The collectives the portable schedule calls, over one process group."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.size = rank_and_size(group)
        self._shifts = 0

    def _neighbour(self, step: int) -> int:
        """The global rank of the rank ``step`` after this one in the group."""
        rank = (self.rank + step) % self.size
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def start_shift(self, arrays: Sequence[Any]) -> Any:
        sent = [a.contiguous() for a in arrays]
        received = [torch.empty_like(a) for a in sent]
        # every rank runs the same schedule: a tag per shift and tensor pairs each
        # receive with its send even when two shifts are in flight (backends with tags)
        tags = [(self._shifts * len(sent) + i) % _TAGS for i in range(len(sent))]
        self._shifts += 1
        after, before = self._neighbour(1), self._neighbour(-1)
        ops = [dist.P2POp(dist.isend, a, after, self.group, tag)
               for a, tag in zip(sent, tags, strict=True)]
        ops += [dist.P2POp(dist.irecv, r, before, self.group, tag)
                for r, tag in zip(received, tags, strict=True)]
        return dist.batch_isend_irecv(ops), sent, received

    def finish_shift(self, handle: Any) -> list[Any]:
        requests, _, received = handle  # the sent tensors stay alive until here
        for request in requests:
            request.wait()
        return received

    def all_gather(self, x: Any) -> list[Any]:
        return all_gather(x, self.group)

    def all_to_all(self, parts: Sequence[Any]) -> list[Any]:
        # a functional collective: differentiable, and traceable by torch.compile
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        group = dist.group.WORLD if self.group is None else self.group
        received = all_to_all_single_autograd(torch.stack(list(parts)), None, None, group)
        return list(received.unbind(0))

    def reduce_scatter(self, parts: Sequence[Any]) -> Any:
        parts = [p.contiguous() for p in parts]
        out = torch.empty_like(parts[self.rank])
        dist.reduce_scatter(out, parts, group=self.group)
        return out


_EAGER = ("portattn.distributed.attention with strategy='ring' or 'all_gather' runs "
          "eagerly under torch.compile (a graph break): the ring's point-to-point "
          "transfers and the autograd.Function over collectives are not traceable, so "
          "fullgraph=True cannot include it ('ulysses' can be traced)")


_eager: dict[str, Any] = {}
"""The ring's and all-gather's entry wrapped as a graph break, made on first use."""


def attention(problem: Problem, query: Any, key: Any, value: Any, group: Any,
              strategy: str) -> tuple[Any, Any]:
    """``(out, lse)`` of this rank's shard, differentiable for query, key, value."""
    if strategy == "ulysses":  # autograd flows through the all-to-alls and the kernel
        return forward(Communicator(group), problem, query, key, value, strategy)
    scheduled = _eager.get("scheduled")
    if scheduled is None:  # wrapped on first use: torch.compiler imports Dynamo (seconds)
        scheduled = _eager["scheduled"] = torch.compiler.disable(_scheduled, reason=_EAGER)
    return scheduled(problem, query, key, value, group, strategy)


def _scheduled(problem: Problem, query: Any, key: Any, value: Any, group: Any,
               strategy: str) -> tuple[Any, Any]:
    return _Attention.apply(query, key, value, _Call(problem, group, strategy))


class _Call:
    """What the autograd node keeps besides tensors."""

    def __init__(self, problem: Problem, group: Any, strategy: str) -> None:
        self.problem, self.group, self.strategy = problem, group, strategy


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: Any, key: Any, value: Any, call: _Call) -> tuple[Any, Any]:
        out, lse = forward(Communicator(call.group), call.problem, query, key, value,
                           call.strategy)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Any, dlse: Any) -> tuple[Any, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        call = ctx.call
        grads = backward(Communicator(call.group), call.problem, query, key, value, out,
                         lse, dout, dlse, call.strategy)
        return *grads, None
