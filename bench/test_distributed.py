"""portattn.distributed: how evenly the ranks share the work, and what they send.

- Visible work per rank (pairs the mask lets attend, from the plan), max / min over
  the ranks, for a causal mask and for packed causal documents, under each layout.
  Target: <= 1.1 for causal and for packed documents.
- Bytes each rank sends per forward and per backward, against the ideal (``(P - 1) / P``
  of K and V per pass), counted on a :class:`~portattn.distributed.LocalGroup` (threads
  as ranks, NumPy float32), for both strategies.
- Forward seconds of each strategy on LocalGroup threads, and what ``"auto"``
  chooses, against the fastest.

Run: ``pytest -c pyproject.toml bench/test_distributed.py -s``.
"""

from __future__ import annotations

import numpy as np
import pytest

from portattn import distributed, masks
from portattn.distributed.engine import Problem, backward, forward, visible_work

FIGURES: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\ncontext parallelism figures:")
    for name, value in FIGURES.items():
        print(f"    {name}: {value:.4g}")


def _documents(length, count=16, seed=0):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length), count - 1, replace=False))
    return np.repeat(np.arange(count), np.diff(np.concatenate([[0], cuts, [length]])))


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("mask_name", ["causal", "documents"])
def test_balance(mask_name, kind, size):
    length = 32768
    mask = masks.causal()
    if mask_name == "documents":
        mask = mask & masks.documents(_documents(length))
    if kind == "balanced":
        layout = distributed.Layout.balanced(mask, length, size)
    else:
        layout = distributed.Layout(kind, length, size)
    bound = mask.bind(np, (), 1, length, length)
    work = visible_work(Problem(np, 0, layout, layout, bound))
    FIGURES[f"{mask_name} {kind} P={size}: work max/min"] = max(work) / min(work)
    if kind == "balanced" or (kind == "zigzag" and mask_name == "causal"):
        assert max(work) / min(work) <= 1.1


class Counting:
    """A communicator that counts the bytes this rank sends."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.sent = inner, inner.rank, inner.size, 0

    def start_shift(self, arrays):
        self.sent += sum(a.nbytes for a in arrays)
        return self.inner.start_shift(arrays)

    def finish_shift(self, handle):
        return self.inner.finish_shift(handle)

    def all_gather(self, x):
        self.sent += x.nbytes * (self.size - 1)  # what a ring all-gather sends
        return self.inner.all_gather(x)

    def reduce_scatter(self, parts):
        self.sent += sum(p.nbytes for i, p in enumerate(parts) if i != self.rank)
        return self.inner.reduce_scatter(parts)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_bytes_sent(strategy):
    size, length = 4, 1024
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, length, 32), dtype=np.float32) for _ in range(3))
    layout = distributed.Layout("zigzag", length, size)

    def rank_work(group):
        comm = Counting(group)
        shards = [layout.shard(x, group.rank) for x in (q, k, v)]
        prob = distributed.problem(*shards, rank=group.rank, size=size, mask=masks.causal(),
                                   layout="zigzag")
        out, lse = forward(comm, prob, *shards, strategy)
        sent_forward = comm.sent
        backward(comm, prob, *shards, out, lse, np.ones_like(out), None, strategy)
        return sent_forward, comm.sent - sent_forward

    sent = distributed.run_local(rank_work, size)
    ideal = (size - 1) / size * (k.nbytes + v.nbytes)
    FIGURES[f"{strategy}: forward bytes per rank / ideal"] = max(f for f, _ in sent) / ideal
    FIGURES[f"{strategy}: backward bytes per rank / ideal"] = max(b for _, b in sent) / ideal
    assert max(f for f, _ in sent) == pytest.approx(ideal)


@pytest.mark.parametrize("case", ["short MHA", "medium MHA", "medium GQA"])
def test_strategy_times(case):
    """Each strategy's forward on 4 threads (LocalGroup, NumPy): nothing crosses a
    network, so this shows what the schedules cost in compute alone; the figures for
    processes (gloo, forward and backward) come from ``distributed_strategies.py``."""
    from distributed_strategies import CASES, _auto, _local

    size = 4
    times = _local(size, [case], repeat=3)
    for (_, strategy), seconds in times.items():
        FIGURES[f"{case} L={CASES[case][0]} P={size} {strategy}: forward s"] = seconds
    fastest = min(t for t in times.values())
    FIGURES[f"{case} P={size} auto ({_auto(case, size)}): time / fastest"] = \
        times[(case, _auto(case, size))] / fastest
