"""Run by test_jax_distributed.py in a fresh process (host devices must be set before
JAX starts): portattn.distributed inside shard_map over a mesh of host devices,
against one float64 call of the whole sequence. Prints one JSON line of errors.

``python jax_distributed_cases.py DEVICES [CASE ...]``: each case runs over its own
number of devices (at most DEVICES)."""

from __future__ import annotations

import json
import os
import sys

from jaxcases import with_host_devices

DEVICES = int(sys.argv[1])
os.environ["XLA_FLAGS"] = with_host_devices(os.environ.get("XLA_FLAGS", ""), DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import portattn  # noqa: E402
from portattn import distributed, masks  # noqa: E402

jax.config.update("jax_enable_x64", True)

# name: (devices, lq, lk, hq, hkv, mask, softcap, strategy, layout)
CASES = {
    "causal_gqa_softcap-ring-zigzag": (4, 23, 23, 4, 2, masks.causal(), 5.0, "ring",
                                       "zigzag"),
    "cross_window-gather-contiguous": (2, 9, 23, 2, 1, masks.sliding_window(6, 3), None,
                                       "all_gather", "contiguous"),
    "causal_gqa-ulysses-zigzag": (2, 23, 23, 4, 2, masks.causal(), None, "ulysses",
                                  "zigzag"),
    "causal-auto-zigzag": (2, 23, 23, 2, 2, masks.causal(), None, "auto", "zigzag"),
}


def run(case):
    size, lq, lk, hq, hkv, mask, softcap, strategy, layout = CASES[case]
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s)) for s in
               ((2, hq, lq, 8), (2, hkv, lk, 8), (2, hkv, lk, 8)))
    gout, glse = jnp.asarray(rng.standard_normal((2, hq, lq, 8))), jnp.asarray(
        rng.standard_normal((2, hq, lq)))
    queries, keys = (distributed.Layout(layout, n, size) for n in (lq, lk))
    mesh = Mesh(np.array(jax.devices()[:size]), ("cp",))
    rows = P(None, None, "cp", None)

    def body(q, k, v):
        return distributed.attention(q, k, v, group="cp", mask=mask, strategy=strategy,
                                     layout=layout, query_length=lq, key_length=lk,
                                     softcap=softcap, return_lse=True)

    split = jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows),
                          out_specs=(rows, P(None, None, "cp")))

    def sharded(q, k, v):
        out, lse = split(queries.rank_major(q), keys.rank_major(k), keys.rank_major(v))
        return queries.from_rank_major(out), queries.from_rank_major(lse[..., None])[..., 0]

    def whole(q, k, v):
        return portattn.attention(q, k, v, mask=mask, softcap=softcap, return_lse=True,
                                  kernel="reference")

    def loss(fn):
        def value(q, k, v):
            out, lse = fn(q, k, v)
            total = (out * gout).sum() + (jnp.where(jnp.isfinite(lse), lse, 0) * glse).sum()
            return total, (out, lse)
        return jax.value_and_grad(value, argnums=(0, 1, 2), has_aux=True)

    (_, got), got_grads = jax.jit(loss(sharded))(q, k, v)
    (_, want), want_grads = loss(whole)(q, k, v)
    names = ("out", "lse", "dq", "dk", "dv")
    return {n: float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for n, a, b in zip(names, (*got, *got_grads), (*want, *want_grads), strict=True)}


if __name__ == "__main__":
    chosen = sys.argv[2:] or list(CASES)
    print(json.dumps({case: run(case) for case in chosen}))
