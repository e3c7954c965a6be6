"""What an engine plugin builds on: the call's :class:`Problem` and the portable
schedule (:func:`forward`, :func:`backward`) run over the engine's
:class:`Communicator`.

An engine is the ``distributed`` part a plugin adds for its array library, in the
entry-point group ``portattn.libraries`` (see :mod:`portattn.autograd`)::

    [project.entry-points."portattn.libraries"]
    torch = "portattn_torch._library"     # whose ``distributed`` is the engine

The engine has ``rank_and_size(group) -> (rank, size)`` (``rank`` None when
it is only known on the device, as inside JAX's ``shard_map``: the engine then runs
:meth:`Problem.for_rank` of each rank in a branch, step by step with
:func:`forward_step` and :func:`backward_step`),
``all_gather(x, group) -> list`` and ``attention(problem, query, key, value, group,
strategy) -> (out, lse)``, the last with the library's autograd attached (its
backward calls :func:`backward`).

An engine whose rank is known on the host also has ``exchange(payload, group, like,
timeout) -> list[bytes]`` (every rank's ``payload``, bytes of one fixed size, in rank
order: one small collective on the device of the array ``like``), its ``attention``
takes ``timeout`` (seconds each collective waits, None for the group's own, then
:class:`~portattn.distributed.CollectiveError`, made by :func:`gave_up`), and it calls
:func:`agree` before its schedule, where host code runs, so ranks that disagree all
raise the same error before any shard moves.
"""

from __future__ import annotations

from .._lib import GROUP
from ._agree import agree
from ._compute import backward_step, forward_step
from ._faults import gave_up
from ._plan import Pair, Problem, visible_work
from ._strategies import STRATEGIES, Communicator, backward, forward

__all__ = ["GROUP", "STRATEGIES", "Communicator", "Pair", "Problem", "agree", "backward",
           "backward_step", "forward", "forward_step", "gave_up", "visible_work"]

