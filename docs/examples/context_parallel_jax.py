"""Train a 2-layer causal transformer with every sequence split over JAX devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python docs/examples/context_parallel_jax.py

Runs on host (CPU) devices; on accelerators drop ``XLA_FLAGS``. One jitted training step
runs the model inside ``jax.shard_map`` over a mesh axis ``"seq"``: each device holds a
shard of every sequence in the zigzag layout (the same causal work on every device),
attention covers the whole sequence through ``portattn.distributed.attention`` with
``group="seq"`` (K/V moving by the ring; ``--strategy auto`` lets the shapes choose, or
name ``all_gather`` or ``ulysses``), and the parameters' gradients are summed over the
devices by JAX (they enter the ``shard_map`` replicated). The same model, from the same
parameters and batches, is then trained on whole sequences on one device with
``portattn.attention``, and both loss curves are printed.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import portattn
from portattn import distributed, masks

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, BATCH = 64, 32, 2, 1, 2, 2
HEAD_DIM = DIM // HEADS


def init(length: int, seed: int = 0) -> dict:
    """The parameters: a dict of float32 arrays."""
    keys = iter(jax.random.split(jax.random.key(seed), 32))

    def dense(n_in, n_out):
        return {"w": jax.random.normal(next(keys), (n_in, n_out)) / math.sqrt(n_in),
                "b": jnp.zeros(n_out)}

    def norm():
        return {"scale": jnp.ones(DIM), "bias": jnp.zeros(DIM)}

    blocks = [{"norm1": norm(), "q": dense(DIM, DIM),
               "kv": dense(DIM, 2 * KV_HEADS * HEAD_DIM), "out": dense(DIM, DIM),
               "norm2": norm(), "up": dense(DIM, 4 * DIM), "down": dense(4 * DIM, DIM)}
              for _ in range(LAYERS)]
    return {"tokens": jax.random.normal(next(keys), (VOCAB, DIM)),
            "positions": jax.random.normal(next(keys), (length, DIM)),
            "blocks": blocks, "norm": norm(), "head": dense(DIM, VOCAB)}


def dense(p, x):
    return x @ p["w"] + p["b"]


def layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def block(p, x, attend):
    b, n, _ = x.shape
    h = layer_norm(p["norm1"], x)
    q = dense(p["q"], h).reshape(b, n, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
    k, v = dense(p["kv"], h).reshape(b, n, 2, KV_HEADS, HEAD_DIM).transpose(2, 0, 3, 1, 4)
    x = x + dense(p["out"], attend(q, k, v).transpose(0, 2, 1, 3).reshape(b, n, DIM))
    return x + dense(p["down"], jax.nn.gelu(dense(p["up"], layer_norm(p["norm2"], x))))


def summed_loss(params, tokens, targets, positions, attend):
    """Cross-entropy summed over the tokens at ``positions`` (-1: padding, left out).
    Everything but ``attend`` works token by token."""
    x = params["tokens"][tokens] + params["positions"][jnp.maximum(positions, 0)]
    for p in params["blocks"]:
        x = block(p, x, attend)
    logits = dense(params["head"], layer_norm(params["norm"], x))
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    return -jnp.where(positions >= 0, picked, 0.0).sum()


def batches(steps: int, length: int):
    """Sequences a model can learn: each token follows from the two before it."""
    rng = np.random.default_rng(1)
    for _ in range(steps):
        tokens = rng.integers(VOCAB, size=(BATCH, length + 1))
        for t in range(2, length + 1):
            tokens[:, t] = (5 * tokens[:, t - 1] + 32 * (tokens[:, t - 2] % 2) + 3) % VOCAB
        yield jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


def adam(params, grads, state, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
    t, m, v = state
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    params = jax.tree.map(
        lambda p, m, v: p - lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps),
        params, m, v)
    return params, (t, m, v)


def train(params: dict, steps: int, length: int, devices: int | None = None,
          layout: str = "zigzag", strategy: str = "ring") -> list[float]:
    """The loss of each step, with each sequence split over ``devices`` devices (None:
    whole sequences on one device, through ``portattn.attention``)."""
    if devices is None:
        def loss_fn(params, tokens, targets):
            def attend(q, k, v):
                return portattn.attention(q, k, v, mask=masks.causal())
            return summed_loss(params, tokens, targets, jnp.arange(length), attend)
    else:
        mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))
        places = distributed.Layout(layout, length, devices)
        # shard_map splits evenly: lay every array out rank after rank; -1: padding
        positions = jnp.asarray(places.rank_major(np.arange(length), axis=-1, fill=-1))

        def attend(q, k, v):
            return distributed.attention(q, k, v, group="seq", mask=masks.causal(),
                                         strategy=strategy, layout=places,
                                         query_length=length, key_length=length)

        def on_each_device(params, tokens, targets, positions):
            return lax.psum(summed_loss(params, tokens, targets, positions, attend), "seq")

        split = jax.shard_map(on_each_device, mesh=mesh, out_specs=P(),
                              in_specs=(P(), P(None, "seq"), P(None, "seq"), P("seq")))

        def loss_fn(params, tokens, targets):
            tokens, targets = (places.rank_major(t, axis=-1) for t in (tokens, targets))
            return split(params, tokens, targets, positions)

    @jax.jit
    def step(params, state, tokens, targets):
        def mean_loss(params):  # divided by every token of the batch
            return loss_fn(params, tokens, targets) / (BATCH * length)
        loss, grads = jax.value_and_grad(mean_loss)(params)
        params, state = adam(params, grads, state)
        return params, state, loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    state = (jnp.zeros((), jnp.float32), zeros, zeros)
    losses = []
    for tokens, targets in batches(steps, length):
        params, state, loss = step(params, state, tokens, targets)
        losses.append(float(loss))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=len(jax.devices()),
                        help="devices to split each sequence over (default: all)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--layout", default="zigzag", choices=distributed.LAYOUTS)
    parser.add_argument("--strategy", default="ring", choices=("auto", *distributed.STRATEGIES),
                        help="how K/V move between ranks ('auto': chosen from the shapes)")
    parser.add_argument("--json", action="store_true",
                        help="print both loss curves as one JSON line at the end")
    args = parser.parse_args()
    if not 1 <= args.devices <= len(jax.devices()):
        parser.error(f"--devices={args.devices}, but JAX sees {len(jax.devices())} devices; "
                     "on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N")
    params = init(args.length)
    split = train(params, args.steps, args.length, args.devices, args.layout, args.strategy)
    whole = train(params, args.steps, args.length)
    for step in range(0, args.steps, 10):
        print(f"step {step:3d}: loss {split[step]:.6f} split over {args.devices} "
              f"devices, {whole[step]:.6f} on one device")
    print("largest difference:", max(abs(a - b) for a, b in zip(split, whole, strict=True)))
    if args.json:
        print(json.dumps({"devices": args.devices, "split": split, "whole": whole}))


if __name__ == "__main__":
    main()
