"""Train a 2-layer causal transformer with every sequence split over the ranks.

    torchrun --nproc-per-node 4 docs/examples/context_parallel_torch.py

Runs on CPU processes (gloo); on GPUs pass ``--backend nccl`` and move the model and
batches to each rank's device. Each rank holds a shard of every sequence, in the zigzag
layout (the same causal work on every rank); attention covers the whole sequence through
``portattn.distributed.attention`` (K/V moving by the ring; ``--strategy auto`` lets the
shapes choose, or name ``all_gather`` or ``ulysses``), and the parameters' gradients are
summed over the ranks. Rank 0 then trains the same model on whole sequences in one
process and prints both loss curves.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import portattn
from portattn import distributed, masks

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, BATCH = 32, 32, 4, 2, 2, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * self.head_dim)
        self.out = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, attend):
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, HEADS, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, KV_HEADS, self.head_dim).permute(2, 0, 3, 1, 4)
        x = x + self.out(attend(q, k, v).transpose(1, 2).reshape(b, n, DIM))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(max_len, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens, positions, attend):
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))


def batches(steps: int, length: int):
    """Sequences a model can learn: each token follows from the two before it."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(VOCAB, (BATCH, length + 1), generator=gen)
        for t in range(2, length + 1):
            tokens[:, t] = (3 * tokens[:, t - 1] + tokens[:, t - 2]) % VOCAB
        yield tokens[:, :-1], tokens[:, 1:]


def train(steps: int, length: int, group=None, layout: str = "zigzag",
          strategy: str = "ring") -> list[float]:
    """The loss of each step, with each sequence split over ``group`` (None: one
    process, whole sequences through ``portattn.attention``)."""
    torch.manual_seed(0)
    model = Model(length)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if group is None:
        positions = torch.arange(length)
        keep = positions >= 0

        def attend(q, k, v):
            return portattn.attention(q, k, v, mask=masks.causal())
    else:
        rank = dist.get_rank(group)
        held = torch.tensor(distributed.Layout(layout, length, dist.get_world_size(group))
                            .positions(rank))
        keep, positions = held >= 0, held.clamp(min=0)  # -1: padding rows

        def attend(q, k, v):
            return distributed.attention(q, k, v, group=group, mask=masks.causal(),
                                         strategy=strategy, layout=layout,
                                         query_length=length, key_length=length)
    losses = []
    for inputs, targets in batches(steps, length):
        if group is not None:
            inputs, targets = (distributed.shard(t, group, axis=-1, layout=layout)
                               for t in (inputs, targets))
        logits = model(inputs, positions, attend)
        # summed over this rank's tokens, divided by every token of the batch
        loss = F.cross_entropy(logits[:, keep].flatten(0, 1), targets[:, keep].flatten(),
                               reduction="sum") / targets.new_tensor(BATCH * length).float()
        optimizer.zero_grad()
        loss.backward()
        loss = loss.detach()
        if group is not None:  # one all-reduce of every gradient and the loss
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.flatten() for g in grads] + [loss.reshape(1)])
            dist.all_reduce(flat, group=group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads] + [1]), strict=False):
                g.copy_(part.view_as(g))
            loss = flat[-1]
        optimizer.step()
        losses.append(float(loss))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--length", type=int, default=61)
    parser.add_argument("--layout", default="zigzag", choices=distributed.LAYOUTS)
    parser.add_argument("--strategy", default="ring", choices=("auto", *distributed.STRATEGIES),
                        help="how K/V move between ranks ('auto': chosen from the shapes)")
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    try:
        split = train(args.steps, args.length, dist.group.WORLD, args.layout, args.strategy)
        if dist.get_rank() == 0:
            whole = train(args.steps, args.length)
            for step in range(0, args.steps, 10):
                print(f"step {step:3d}: loss {split[step]:.6f} split over "
                      f"{dist.get_world_size()} ranks, {whole[step]:.6f} in one process")
            print("largest difference:", max(abs(a - b) for a, b in zip(split, whole, strict=True)))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
