"""The masks of real batches on the JAX kernels: key ranges (left padding), forward
and gradients; large packed calls go to jax_flash."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.testing import assert_close, oracle
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = jax.numpy

START, STOP = [0, 7, 39], [40, 30, 40]


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((3, 4, 40, 16)), rng.standard_normal((3, 2, 40, 16)),
            rng.standard_normal((3, 2, 40, 8)))


def left_padded(q, k, v):
    """The reference with the same pairs given as a dense boolean mask."""
    i, j = np.arange(40)[:, None], np.arange(40)[None, :]
    allowed = np.stack([(j <= i) & (lo <= j) & (j < hi)
                        for lo, hi in zip(START, STOP, strict=True)])[:, None]
    return oracle(q, k, v, mask=masks.dense(allowed))[0]


@pytest.mark.parametrize("kernel", ["jax_flash", "jax_dpa"])
def test_key_ranges_with_causal(kernel):
    q, k, v = arrays()
    mask = masks.causal() & masks.key_ranges(jnp.array(START), jnp.array(STOP))
    got = portattn.attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), mask=mask,
                             kernel=kernel)
    assert_close(got, left_padded(q, k, v), "float32")


def test_key_ranges_gradients_on_jax_flash():
    q, k, v = (jnp.asarray(a, jnp.float32) for a in arrays(1))
    mask = masks.causal() & masks.key_ranges(jnp.array(START), jnp.array(STOP))

    def loss(kernel):
        return jax.grad(lambda *a: jnp.sum(jnp.cos(portattn.attention(
            *a, mask=mask, kernel=kernel))), argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(loss("jax_flash"), loss("reference"), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_large_packed_calls_go_to_jax_flash():
    q = jnp.zeros((1, 8, 4096, 64), jnp.float32)
    ids = jnp.repeat(jnp.arange(8), 512)[None]
    plan = portattn.explain(q, q, q, mask=masks.causal() & masks.documents(ids))
    assert plan.kernel.name == "jax_flash", str(plan)
