"""``jax.debug_infs(True)``: no kernel makes an infinity its result does not hold, in
the forward or the gradients (hidden scores are finite; ``-inf`` is made only for the
lse of rows that attend nothing)."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.testing.plugin import require_library


def _masks(jnp):
    # every row attends some key: no -inf belongs in any result
    return {
        "none": None,
        "causal": masks.causal(),
        "padding": masks.causal() & masks.key_lengths(jnp.asarray([5, 8])),
        "documents": masks.causal() & masks.documents(
            jnp.asarray([[0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1]])),
        "sparse": (masks.sliding_window(2) | masks.global_tokens(jnp.asarray([1]))
                   | masks.sink_tokens(2)) & masks.chunks(6),
        "function": masks.function(lambda b, h, i, j: (i + j) % 3 != 1),
    }


@pytest.mark.parametrize("name", ["none", "causal", "padding", "documents", "sparse",
                                  "function"])
def test_no_kernel_makes_an_infinity(name):
    jax = require_library("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 8, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 2, 8, 16)), jnp.float32) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)
    mask = _masks(jnp)[name]
    ran = []
    for entry in portattn.kernels():
        if entry.kernel is None or not (entry.kernel.namespaces == "*"
                                        or "jax" in entry.kernel.namespaces):
            continue
        for extra in ({"bias": bias, "return_lse": True}, {"return_lse": True}, {}):
            if portattn.explain(q, k, v, mask=mask, kernel=entry.name,
                                **extra).kernel is None:
                continue
            want = portattn.attention(q, k, v, mask=mask, kernel=entry.name, **extra)
            with jax.debug_infs(True):
                got = portattn.attention(q, k, v, mask=mask, kernel=entry.name, **extra)
                if entry.kernel.grad:
                    def loss(q, extra=extra, name=entry.name):
                        out = portattn.attention(q, k, v, mask=mask, kernel=name, **extra)
                        return jnp.sum(out[0] if isinstance(out, tuple) else out)
                    assert jnp.all(jnp.isfinite(jax.grad(loss)(q)))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            ran.append(entry.name)
            break
    assert {"tiled", "reference"} <= set(ran), ran
