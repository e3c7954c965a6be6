"""The ``torch.distributed`` engine of :mod:`portattn.distributed`.

The ``distributed`` engine this plugin adds for torch (``_library``).
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

Before the schedule the ranks agree on the call (:func:`exchange`: one ``all_gather``
of a small fixed-size ``uint8`` tensor, then portattn's check), inside the eager part
of the call; a traced ``"ulysses"`` call skips it. Every collective is started
asynchronously and waited for with the call's ``timeout`` (``Work.wait(timeout)``;
None: the group's own), so a rank that failed, died or never came turns into
:class:`~portattn.distributed.CollectiveError` on the others. The dK/dV of the
all-gather's backward are summed by an all-to-all and an addition on their owner:
gloo's ``reduce_scatter`` blocks inside the call, where no timeout reaches it. Traced
``"ulysses"`` calls use functional collectives, which wait as long as the group's
own timeout.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from portattn.distributed.engine import agree, backward, forward, gave_up

if TYPE_CHECKING:
    from collections.abc import Sequence

    from portattn.distributed.engine import Problem

__all__ = ["all_gather", "attention", "exchange", "rank_and_size"]

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


def all_gather(x: Any, group: Any, timeout: float | None = None) -> list[Any]:
    """Every rank's ``x``, in rank order."""
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(out, x, group=group, async_op=True)
    _wait(work, group, timeout, "in an all_gather")
    return out


def exchange(payload: bytes, group: Any, like: Any, timeout: float | None) -> list[bytes]:
    """Every rank's ``payload`` (bytes of one size on every rank), in rank order: one
    all_gather of a ``uint8`` tensor on the device of ``like`` (where the group's
    backend moves tensors)."""
    sent = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(like.device)
    got = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(got, sent, group=group, async_op=True)
    _wait(work, group, timeout, "while the ranks compared their calls")
    return [t.cpu().numpy().tobytes() for t in got]


def _wait(work: Any, group: Any, timeout: float | None, where: str) -> None:
    """Wait for ``work``; a timeout or a lost rank becomes a ``CollectiveError``."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as e:  # gloo and NCCL: timed out, or a peer went away
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        limit = "the group's timeout" if timeout is None else f"timeout={timeout:g} s"
        why = (f"{str(e).strip()} (another rank failed, was killed, or did not answer "
               f"within {limit})")
        raise gave_up(rank, size, where, why) from e


class Communicator:
    """The collectives the portable schedule calls, over one process group, each
    waited for at most ``timeout`` seconds."""

    def __init__(self, group: Any, timeout: float | None = None) -> None:
        self.group, self.timeout = group, timeout
        self.rank, self.size = rank_and_size(group)
        self._shifts = 0

    def exchange(self, payload: bytes, like: Any) -> list[bytes]:
        return exchange(payload, self.group, like, self.timeout)

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
        return dist.batch_isend_irecv(ops), sent, received, self._shifts - 1

    def finish_shift(self, handle: Any) -> list[Any]:
        requests, _, received, shift = handle  # the sent tensors stay alive until here
        before = (self.rank - 1) % self.size
        for request in requests:
            _wait(request, self.group, self.timeout,
                  f"in shift {shift} (to rank {(self.rank + 1) % self.size}, from rank "
                  f"{before})")
        return received

    def all_gather(self, x: Any) -> list[Any]:
        return all_gather(x, self.group, self.timeout)

    def all_to_all(self, parts: Sequence[Any]) -> list[Any]:
        stacked = torch.stack(list(parts))
        if torch.compiler.is_compiling():
            # a functional collective: differentiable, and traceable by torch.compile
            from torch.distributed._functional_collectives import all_to_all_single_autograd

            group = dist.group.WORLD if self.group is None else self.group
            received = all_to_all_single_autograd(stacked, None, None, group)
        else:  # eager: the same exchange, waited for with the call's timeout
            received = _AllToAll.apply(stacked, self)
        return list(received.unbind(0))

    def all_to_all_single(self, x: Any, where: str = "in an all_to_all") -> Any:
        """Row ``i`` of ``x`` to rank ``i``; row ``j`` of the result from rank ``j``."""
        x = x.contiguous()
        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x, group=self.group, async_op=True)
        _wait(work, self.group, self.timeout, where)
        return out

    def reduce_scatter(self, parts: Sequence[Any]) -> Any:
        # an all-to-all and the sum on the owner, in rank order: gloo's reduce_scatter
        # blocks inside the call, past any timeout given to its wait
        received = self.all_to_all_single(torch.stack(list(parts)),
                                          "in the reduce-scatter of dK/dV")
        return received.sum(dim=0)


_EAGER = ("portattn.distributed.attention with strategy='ring' or 'all_gather' runs "
          "eagerly under torch.compile (a graph break): the ring's point-to-point "
          "transfers and the autograd.Function over collectives are not traceable, so "
          "fullgraph=True cannot include it ('ulysses' can be traced)")


_eager: dict[str, Any] = {}
"""The ring's and all-gather's entry wrapped as a graph break, made on first use."""


def attention(problem: Problem, query: Any, key: Any, value: Any, group: Any,
              strategy: str, *, timeout: float | None = None) -> tuple[Any, Any]:
    """``(out, lse)`` of this rank's shard, differentiable for query, key, value, once
    the ranks agree on the call; each collective waits at most ``timeout`` seconds."""
    if strategy == "ulysses":  # autograd flows through the all-to-alls and the kernel
        comm = Communicator(group, timeout)
        if not torch.compiler.is_compiling():  # a traced call cannot wait on the host
            _agree(comm, problem, query, key, value, strategy)
        return forward(comm, problem, query, key, value, strategy)
    scheduled = _eager.get("scheduled")
    if scheduled is None:  # wrapped on first use: torch.compiler imports Dynamo (seconds)
        scheduled = _eager["scheduled"] = torch.compiler.disable(_scheduled, reason=_EAGER)
    return scheduled(problem, query, key, value, group, strategy, timeout)


def _agree(comm: Communicator, problem: Problem, query: Any, key: Any, value: Any,
           strategy: str) -> None:
    agree(problem, query, key, value, strategy,
          lambda payload: comm.exchange(payload, query))


def _scheduled(problem: Problem, query: Any, key: Any, value: Any, group: Any,
               strategy: str, timeout: float | None) -> tuple[Any, Any]:
    call = _Call(problem, group, strategy, timeout)
    _agree(Communicator(group, timeout), problem, query, key, value, strategy)
    return _Attention.apply(query, key, value, call)


class _AllToAll(torch.autograd.Function):
    """An all-to-all whose gradient is the all-to-all of the gradients (it only moves
    rows between ranks)."""

    @staticmethod
    def forward(ctx: Any, x: Any, comm: Communicator) -> Any:
        ctx.comm = comm
        return comm.all_to_all_single(x)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        return ctx.comm.all_to_all_single(grad), None


class _Call:
    """What the autograd node keeps besides tensors."""

    def __init__(self, problem: Problem, group: Any, strategy: str,
                 timeout: float | None) -> None:
        self.problem, self.group, self.strategy = problem, group, strategy
        self.timeout = timeout


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: Any, key: Any, value: Any, call: _Call) -> tuple[Any, Any]:
        out, lse = forward(Communicator(call.group, call.timeout), call.problem, query, key,
                           value, call.strategy)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Any, dlse: Any) -> tuple[Any, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        call = ctx.call
        grads = backward(Communicator(call.group, call.timeout), call.problem, query, key,
                         value, out, lse, dout, dlse, call.strategy)
        return *grads, None
