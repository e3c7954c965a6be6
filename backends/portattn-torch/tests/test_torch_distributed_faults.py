"""portattn.distributed over torch.distributed when ranks disagree or fail: 3 gloo
processes on loopback run one scenario after another (each in its own process group),
and every rank writes what it raised. Ranks that disagree, a rank that cannot start,
a rank raising in the middle of the schedule (forward or backward), a rank that never
calls and a rank killed: every rank ends with an error within the timeout, none
hangs, none dies without a Python exception (gloo's ``std::terminate`` on shards of
another size used to kill the process).

One spawn runs every scenario (starting processes costs seconds); the tests read what
each rank wrote.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import portattn  # noqa: E402
from portattn import distributed, masks  # noqa: E402
from portattn.distributed import _compute, _strategies  # noqa: E402

SIZE, LENGTH = 3, 24
TIMEOUT = 2.0  # seconds each collective of a failing scenario waits
DEADLINE = 240  # seconds for the whole spawn; more means a rank hung
SCENARIOS = ("lengths", "masks", "shard_length", "dtype", "cannot_start", "global_tokens",
             "sequence_masks", "never_arrives", "group_timeout", "raise_forward",
             "raise_backward", "killed")
GROUP_TIMEOUT = 3.0  # the process group's own timeout in "group_timeout"


def _data(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, LENGTH, 8, generator=gen, dtype=torch.float64).to(dtype)
            for _ in range(3)]


def _shards(xs, group=None, layout="zigzag"):
    return [distributed.shard(x, group, layout=layout) for x in xs]


def _error_of(mask, strategy, layout="zigzag"):
    """Largest difference of this rank's output and gradients from one float64 call."""
    q, k, v = _data(torch.float64)
    shards = [s.requires_grad_() for s in _shards((q, k, v), layout=layout)]
    out = distributed.attention(*shards, group=None, mask=mask, strategy=strategy,
                                layout=layout, query_length=LENGTH, key_length=LENGTH)
    out.square().sum().backward()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = portattn.attention(*leaves, mask=mask, kernel="reference")
    want.square().sum().backward()
    pairs = [(out, distributed.shard(want.detach(), None, layout=layout))]
    pairs += [(s.grad, distributed.shard(w.grad, None, layout=layout))
              for s, w in zip(shards, leaves, strict=True)]
    return max(float((a.detach() - b).abs().max()) for a, b in pairs)


def _fail_at_other_keys(rank, how):
    """Patch the forward so that ``rank`` fails when it reaches another rank's keys."""
    original = _compute.Partials.add

    def add(self, pair, key, value):
        if self.problem.rank == rank and pair.source != rank:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            msg = "injected failure"
            raise RuntimeError(msg)
        return original(self, pair, key, value)

    _compute.Partials.add = add
    return lambda: setattr(_compute.Partials, "add", original)


def _fail_in_backward(rank):
    original = _strategies.add_pair_grads

    def add_pair_grads(problem, pair, *args):
        if problem.rank == rank and pair.source != rank:
            msg = "injected backward failure"
            raise RuntimeError(msg)
        return original(problem, pair, *args)

    _strategies.add_pair_grads = add_pair_grads
    return lambda: setattr(_strategies, "add_pair_grads", original)


def _scenario(name, rank):
    """What rank ``rank`` does in scenario ``name`` (the default group is its own)."""
    q, k, v = _data()
    causal = masks.causal()
    if name == "lengths":  # 24 and 23 positions both give shards of 8 rows
        n = 23 if rank == 2 else LENGTH
        return distributed.attention(*_shards((q, k, v)), group=None, mask=causal,
                                     layout="zigzag", query_length=n, key_length=n)
    if name == "masks":
        mask = masks.sliding_window(3) if rank == 1 else causal
        return distributed.attention(*_shards((q, k, v)), group=None, mask=mask,
                                     layout="zigzag")
    if name == "shard_length":  # what gloo's all_gather used to terminate the process on
        shards = _shards((q, k, v))
        if rank == 1:
            shards = [s[..., :-1, :] for s in shards]
        return distributed.attention(*shards, group=None, strategy="all_gather")
    if name == "dtype":
        shards = _shards((q, k, v))
        if rank == 1:
            shards = [s.double() for s in shards]
        return distributed.attention(*shards, group=None, strategy="all_gather")
    if name == "cannot_start":
        positions = torch.tensor([0.5]) if rank == 1 else torch.tensor([0])
        return distributed.attention(*_shards((q, k, v)), group=None,
                                     mask=masks.global_tokens(positions), layout="zigzag")
    if name == "global_tokens":  # "auto" gathers K/V this small
        mask = masks.sliding_window(2) | masks.global_tokens(torch.tensor([0, 5, LENGTH - 1]))
        return {s: _error_of(mask, s) for s in ("auto", "ring")}
    if name == "sequence_masks":
        causal_seq = masks.sequence_causal(torch.tensor([LENGTH - 3]), torch.tensor([LENGTH]))
        window = masks.sequence_window(4, 1, query_lengths=torch.tensor([LENGTH]),
                                       key_lengths=torch.tensor([LENGTH - 5]))
        return {f"{m}-{s}": _error_of(mask, s, layout)
                for m, mask in (("causal", causal_seq), ("window", window))
                for s in ("ring", "all_gather") for layout in ("contiguous", "zigzag")}
    if name in ("never_arrives", "group_timeout"):
        if rank == 2:
            return "stayed away"
        timeout = None if name == "group_timeout" else TIMEOUT
        return distributed.attention(*_shards((q, k, v)), group=None, mask=causal,
                                     timeout=timeout)
    if name in ("raise_forward", "killed"):
        undo = _fail_at_other_keys(1, "kill" if name == "killed" else "raise")
        try:
            return distributed.attention(*_shards((q, k, v)), group=None, mask=causal,
                                         strategy="ring", layout="zigzag",
                                         timeout=30 if name == "killed" else TIMEOUT)
        finally:
            undo()
    if name == "raise_backward":
        undo = _fail_in_backward(1)
        try:
            shards = [s.requires_grad_() for s in _shards((q, k, v))]
            out = distributed.attention(*shards, group=None, mask=causal,
                                        strategy="all_gather", layout="zigzag",
                                        timeout=TIMEOUT)
            out.sum().backward()
            return "finished"
        finally:
            undo()
    msg = f"no scenario named {name!r}"
    raise ValueError(msg)


def _worker(rank, ports, folder):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", ports[0], SIZE, rank == 0,
                          timeout=timedelta(seconds=DEADLINE))
    with open(Path(folder) / f"rank{rank}.jsonl", "a") as log:
        for name, port in zip(SCENARIOS, ports[1:], strict=True):
            group_timeout = GROUP_TIMEOUT if name == "group_timeout" else 120
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=rank, world_size=SIZE,
                                    timeout=timedelta(seconds=group_timeout))
            start = time.monotonic()
            record = {"scenario": name, "rank": rank}
            try:
                result = _scenario(name, rank)
                record["result"] = result if isinstance(result, (str, dict)) else "returned"
            except Exception as e:
                record.update(error=type(e).__name__, message=str(e))
            record["seconds"] = time.monotonic() - start
            log.write(json.dumps(record) + "\n")
            log.flush()
            # every rank has its outcome before any group goes away (a rank that
            # failed stays until the others stopped waiting for it)
            store.set(f"{name}/{rank}", "done")
            store.wait([f"{name}/{r}" for r in range(SIZE) if r != 1 or name != "killed"])
            dist.destroy_process_group()


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """``{scenario: [rank 0's record, ...]}`` and the processes' exit codes."""
    folder = tmp_path_factory.mktemp("faults")
    ports = _free_ports(len(SCENARIOS) + 1)
    context = torch.multiprocessing.get_context("spawn")
    processes = [context.Process(target=_worker, args=(r, ports, os.fspath(folder)))
                 for r in range(SIZE)]
    for p in processes:
        p.start()
    end = time.monotonic() + DEADLINE
    for p in processes:
        p.join(max(0.0, end - time.monotonic()))
    hung = [r for r, p in enumerate(processes) if p.is_alive()]
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    found = {name: [None] * SIZE for name in SCENARIOS}
    for r in range(SIZE):
        path = folder / f"rank{r}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            found[record["scenario"]][r] = record
    return {"by_scenario": found, "exitcodes": [p.exitcode for p in processes],
            "hung": hung}


def test_no_rank_hangs_or_dies_without_an_exception(outcomes):
    assert outcomes["hung"] == [], outcomes
    # rank 1 is killed in the last scenario; the others end normally
    assert outcomes["exitcodes"] == [0, -signal.SIGKILL, 0], outcomes["exitcodes"]
    for name, records in outcomes["by_scenario"].items():
        alive = [r for rank, r in enumerate(records) if (name, rank) != ("killed", 1)]
        assert all(r is not None for r in alive), (name, records)


def _same_value_error(records, *texts):
    assert [r.get("error") for r in records] == ["ValueError"] * SIZE, records
    assert len({r["message"] for r in records}) == 1, records
    for text in texts:
        assert text in records[0]["message"], (text, records[0]["message"])


@pytest.mark.parametrize(("name", "texts"), [
    ("lengths", ["query_length: 24 on ranks 0, 1; 23 on rank 2",
                 "key_length: 24 on ranks 0, 1; 23 on rank 2"]),
    ("masks", ["mask: causal(bottom_right)", "on ranks 0, 2",
               "sliding_window(left=3, right=0)", "on rank 1"]),
    ("shard_length", ["query.shape: (1, 2, 8, 8) on ranks 0, 2; (1, 2, 7, 8) on rank 1",
                      "key.shape:"]),
    ("dtype", ["query.dtype: float32 on ranks 0, 2; float64 on rank 1"]),
])
def test_ranks_that_disagree_fail_together(outcomes, name, texts):
    _same_value_error(outcomes["by_scenario"][name], *texts)


def test_a_rank_that_cannot_start_stops_the_others(outcomes):
    records = outcomes["by_scenario"]["cannot_start"]
    assert records[1]["error"] == "TypeError", records
    assert "global_tokens positions must have an integer dtype" in records[1]["message"]
    for r in (0, 2):
        assert records[r]["error"] == "ValueError", records
        assert "rank 1 of 3 could not start the call" in records[r]["message"]
        assert "global_tokens positions must have an integer dtype" in records[r]["message"]


@pytest.mark.parametrize("name", ["global_tokens", "sequence_masks"])
def test_masks_of_whole_sequence_values_run_on_every_strategy(outcomes, name):
    """Global token positions and per-sequence lengths are whole-sequence values: each
    pair of shards restricts them without checking them against its own lengths."""
    for record in outcomes["by_scenario"][name]:
        assert "error" not in record, record
        assert max(record["result"].values()) < 1e-10, record


@pytest.mark.parametrize(("name", "limit"), [("never_arrives", "timeout=2 s"),
                                             ("group_timeout", "the group's timeout")])
def test_a_rank_that_never_calls_times_the_others_out(outcomes, name, limit):
    records = outcomes["by_scenario"][name]
    assert records[2]["result"] == "stayed away"
    for r in (0, 1):
        assert records[r]["error"] == "CollectiveError", records
        assert "while the ranks compared their calls" in records[r]["message"]
        assert limit in records[r]["message"]


@pytest.mark.parametrize(("name", "own", "where"), [
    ("raise_forward", "injected failure", "in shift"),
    ("raise_backward", "injected backward failure", "in the reduce-scatter of dK/dV"),
])
def test_a_rank_raising_mid_schedule_ends_every_rank(outcomes, name, own, where):
    """The failing rank stays alive: the others raise when the timeout ends their
    wait for it."""
    records = outcomes["by_scenario"][name]
    assert records[1]["error"] == "RuntimeError", records
    assert records[1]["message"] == own
    for r in (0, 2):
        assert records[r]["error"] == "CollectiveError", records
        assert where in records[r]["message"]


def test_a_killed_rank_ends_every_other_rank(outcomes):
    """Gloo hears of the closed connection: the others raise before the timeout."""
    records = outcomes["by_scenario"]["killed"]
    assert records[1] is None  # it never wrote: killed
    for r in (0, 2):
        assert records[r]["error"] == "CollectiveError", records
        assert "gave up in shift" in records[r]["message"]
