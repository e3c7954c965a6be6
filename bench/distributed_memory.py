"""Peak memory per rank of portattn.distributed, forward and backward, against one
process holding the whole sequence (torch on CPU processes, gloo).

Each process records its tensor allocations during the step with torch's profiler
(``profile_memory``) and reports their peak: the inputs it holds (the whole sequence, or
its shards), the output, the gradients and every temporary, not the torch runtime.

Run: ``python bench/distributed_memory.py --length 32768 --ranks 4``.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist

import portattn
from portattn import distributed, masks

HEADS, DIM = 4, 64


def _inputs(length):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, HEADS, length, DIM, generator=gen) for _ in range(3)]


def _measure(step, length) -> tuple[float, float]:
    """Peak MiB of the tensors allocated by ``step(whole inputs)``, and its seconds."""
    from torch.profiler import ProfilerActivity, profile

    step(_inputs(64))  # warm-up
    inputs = _inputs(length)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(inputs)
    seconds = time.perf_counter() - start
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20, seconds


def _single(length):
    torch.set_num_threads(1)

    def step(inputs):
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        portattn.attention(q, k, v, mask=masks.causal()).sum().backward()

    return _measure(step, length)


def _rank(rank, size, port, length, strategy, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)

    def step(inputs):
        n = inputs[0].shape[-2]
        # every rank's shards are its own arrays (a middle rank's zigzag shard is a
        # slice of the whole inputs, which the measurement would not count)
        q, k, v = (distributed.shard(x, (rank, size), layout="zigzag").contiguous()
                   .requires_grad_() for x in inputs)
        distributed.attention(q, k, v, group=None, mask=masks.causal(), layout="zigzag",
                              strategy=strategy, query_length=n,
                              key_length=n).sum().backward()

    mib, seconds = _measure(step, length)
    gathered = [None] * size
    dist.all_gather_object(gathered, (mib, seconds))
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--strategy", default="ring", choices=distributed.STRATEGIES)
    args = parser.parse_args()
    whole_mib, whole_s = _single(args.length)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "ranks.pt")
    torch.multiprocessing.spawn(_rank, args=(args.ranks, port, args.length, args.strategy,
                                             out), nprocs=args.ranks)
    ranks = torch.load(out)
    print(f"L={args.length}, {HEADS} heads of {DIM}, float32, causal, forward + backward")
    print(f"one process: peak {whole_mib:.1f} MiB, {whole_s:.1f} s")
    for r, (mib, seconds) in enumerate(ranks):
        print(f"rank {r} of {args.ranks} ({args.strategy}): peak {mib:.1f} MiB "
              f"({mib / whole_mib:.2f}x), {seconds:.1f} s")


if __name__ == "__main__":
    main()
