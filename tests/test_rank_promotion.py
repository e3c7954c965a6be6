"""JAX's strict broadcasting (``jax.numpy_rank_promotion("raise")``, as JAX's own test
suites run): every JAX kernel, every mask kind, forward and gradients."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.testing.plugin import require_library


def _masks(jnp):
    lengths = jnp.asarray([5, 8])
    ids = jnp.asarray([[0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 1, 1, 1, -1]])
    return {
        "padding": masks.causal() & masks.key_lengths(lengths) & masks.query_lengths(
            jnp.asarray([3, 8])) & masks.documents(ids),
        "ranges": masks.key_ranges(jnp.asarray([1, 0]), lengths) & masks.query_ranges(
            jnp.asarray([0, 2]), jnp.asarray([8, 7])),
        "per_sequence": masks.sequence_window(2, 0, query_lengths=jnp.asarray([3, 8]),
                                              key_lengths=lengths),
        "sparse": (masks.sliding_window(2) | masks.global_tokens(jnp.asarray([1]))
                   | masks.sink_tokens(2)) & masks.chunks(6),
        "prefix_and_layout": (masks.causal() | masks.prefix(jnp.asarray([3, 4])))
        & masks.block_layout(jnp.asarray([[True, False], [True, True]]), 4, 4),
        "dense_and_function": masks.dense(jnp.tril(jnp.ones((8, 8), bool)))
        & masks.function(lambda b, h, i, j: (i + j) % 3 != 1, args=()),
    }


@pytest.mark.parametrize("name", ["padding", "ranges", "per_sequence", "sparse",
                                  "prefix_and_layout", "dense_and_function"])
def test_every_jax_kernel_under_strict_rank_promotion(name):
    jax = require_library("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 8, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 2, 8, 16)), jnp.float32) for _ in range(2))
    options = {"bias": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32),
               "alibi_slopes": jnp.asarray([0.5, 0.25, 0.125, 0.0625]),
               "sinks": jnp.zeros(4)}
    ran = []
    with jax.numpy_rank_promotion("raise"):
        mask = _masks(jnp)[name]
        for entry in portattn.kernels():
            if entry.kernel is None or not (entry.kernel.namespaces == "*"
                                            or "jax" in entry.kernel.namespaces):
                continue
            # the most each kernel takes: all options, then none
            for extra in (options, {}):
                if portattn.explain(q, k, v, mask=mask, kernel=entry.name,
                                    **extra).kernel is None:
                    continue
                out = portattn.attention(q, k, v, mask=mask, kernel=entry.name, **extra)
                assert out.shape == (2, 4, 8, 16)
                if entry.kernel.grad:
                    def loss(q, mask, extra=extra, name=entry.name):
                        return jnp.sum(portattn.attention(q, k, v, mask=mask, kernel=name,
                                                          **extra))
                    assert jax.jit(jax.grad(loss))(q, mask).shape == q.shape
                ran.append(entry.name)
                break
    assert {"tiled", "reference"} <= set(ran), ran
