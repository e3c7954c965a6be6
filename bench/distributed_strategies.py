"""Time each strategy of portattn.distributed, and say what ``"auto"`` chooses.

One sequence (causal, zigzag layout, float32) over ``--ranks`` CPU processes (torch,
gloo; forward and backward) or threads (``--engine local``: a LocalGroup on NumPy,
forward only), for short and long sequences, with as many K/V heads as query heads
(MHA) and with one (GQA-heavy). Each rank times the step between barriers; the figure
is the slowest rank's, the median of ``--repeat`` runs after one warm-up, the
strategies taking turns.

Run: ``python bench/distributed_strategies.py --ranks 2`` (add ``--engine local``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import numpy as np

from portattn import distributed, masks

STRATEGIES = ("ring", "all_gather", "ulysses")
CASES = {  # name: (length, query heads, K/V heads, head dim)
    "short MHA": (1024, 8, 8, 32),
    "short GQA": (1024, 8, 1, 32),
    "medium MHA": (4096, 8, 8, 32),
    "medium GQA": (4096, 8, 1, 32),
    "long MHA": (8192, 8, 8, 32),
    "long GQA": (8192, 8, 1, 32),
}


def _inputs(case, xp_from_numpy):
    length, hq, hkv, d = CASES[case]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, hq, length, d), dtype=np.float32)
    k, v = (rng.standard_normal((1, hkv, length, d), dtype=np.float32) for _ in range(2))
    return [xp_from_numpy(x) for x in (q, k, v)]


def _possible(case, strategy, size):
    _, hq, hkv, _ = CASES[case]
    return strategy != "ulysses" or (hq % size == 0 and hkv % size == 0)


def _auto(case, size):
    length, hq, hkv, d = CASES[case]
    shard = length // size
    q = np.zeros((1, hq, shard, d), dtype=np.float32)
    kv = np.zeros((1, hkv, shard, d), dtype=np.float32)
    return distributed.explain(q, kv, kv, size=size, mask=masks.causal(),
                               layout="zigzag").strategy


def _gloo_rank(rank, size, port, cases, repeat, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    results = {}
    for case in cases:
        whole = _inputs(case, torch.from_numpy)
        n = whole[0].shape[-2]
        names = [s for s in STRATEGIES if _possible(case, s, size)]
        times = {s: [] for s in names}
        for _ in range(repeat + 1):  # in turns, so a change of load hits them alike
            for strategy in names:
                q, k, v = (distributed.shard(x, (rank, size), layout="zigzag")
                           .requires_grad_() for x in whole)
                dist.barrier()
                start = time.perf_counter()
                out_ = distributed.attention(q, k, v, group=None, mask=masks.causal(),
                                             layout="zigzag", strategy=strategy,
                                             query_length=n, key_length=n)
                out_.sum().backward()
                dist.barrier()
                times[strategy].append(time.perf_counter() - start)
        for strategy in names:
            results[(case, strategy)] = statistics.median(times[strategy][1:])
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _gloo(size, cases, repeat):
    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "times.pt")
    torch.multiprocessing.spawn(_gloo_rank, args=(size, port, cases, repeat, out),
                                nprocs=size)
    return torch.load(out)


def _local(size, cases, repeat):
    results = {}
    for case in cases:
        q, k, v = _inputs(case, lambda x: x)
        n = q.shape[-2]
        names = [s for s in STRATEGIES if _possible(case, s, size)]

        def rank_work(group, strategy, whole=(q, k, v), n=n):
            shards = [distributed.shard(x, group, layout="zigzag") for x in whole]
            group.all_gather(None)  # start together
            start = time.perf_counter()
            distributed.attention(*shards, group=group, mask=masks.causal(),
                                  layout="zigzag", strategy=strategy, query_length=n,
                                  key_length=n)
            group.all_gather(None)
            return time.perf_counter() - start

        times = {s: [] for s in names}
        for _ in range(repeat + 1):  # in turns
            for strategy in names:
                seconds = distributed.run_local(
                    lambda group, strategy=strategy: rank_work(group, strategy), size)
                times[strategy].append(max(seconds))
        for strategy in names:
            results[(case, strategy)] = statistics.median(times[strategy][1:])
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--engine", choices=("gloo", "local"), default="gloo")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, from: {', '.join(CASES)}")
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",")]
    run = _gloo if args.engine == "gloo" else _local
    results = run(args.ranks, cases, args.repeat)
    what = "forward + backward" if args.engine == "gloo" else "forward"
    print(f"{args.ranks} ranks ({args.engine}), causal, zigzag, float32, {what}; "
          "seconds, slowest rank, median")
    for case in cases:
        times = {s: results[(case, s)] for s in STRATEGIES if (case, s) in results}
        best = min(times, key=times.get)
        cells = "  ".join(f"{s} {t:.3f}" for s, t in times.items())
        print(f"{case:10s} L={CASES[case][0]:5d}: {cells}  fastest: {best}, "
              f"auto: {_auto(case, args.ranks)}")


if __name__ == "__main__":
    main()
