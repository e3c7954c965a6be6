"""Context parallelism: exact attention over a sequence split across ranks.

Each rank holds a shard of the sequence (:func:`shard`, under a :class:`Layout`:
``"contiguous"`` or ``"zigzag"``, any length, padded internally) and
:func:`attention` returns its shard of the exact output, differentiable for query,
key, value and the log-sum-exp. Masks stay in global positions; pairs of shards a mask
hides are never computed. The schedule (``"ring"``, ``"all_gather"`` or
``"ulysses"``; ``"auto"`` chooses one, and :func:`explain` says which and why) is written
once against a :class:`~portattn.distributed.engine.Communicator`; engines
(``torch.distributed`` in portattn-torch) supply the collectives and the autograd, and
:class:`LocalGroup` runs ranks as threads of one process.

Before the schedule the ranks agree on the call (shapes, dtypes, lengths, layout,
strategy, mask) in one small collective and fail together when they do not; every
collective waits at most ``timeout`` seconds, then raises :class:`CollectiveError`.
"""

from __future__ import annotations

from . import engine
from ._api import attention, explain, gradients, problem, shard, unshard
from ._choice import StrategyChoice, StrategyOption
from ._faults import CollectiveError
from ._layout import LAYOUTS, Layout, Segment
from ._local import LocalGroup, run_local
from ._strategies import STRATEGIES

__all__ = ["LAYOUTS", "STRATEGIES", "CollectiveError", "Layout", "LocalGroup", "Segment",
           "StrategyChoice", "StrategyOption", "attention", "engine", "explain", "gradients",
           "problem", "run_local", "shard", "unshard"]
