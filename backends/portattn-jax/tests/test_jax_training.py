"""A tiny causal transformer trains along the same loss curve with portattn as with
``jax.nn.dot_product_attention``: the forward and the gradients agree step after step.

Two layers, d_model 32, 2 heads, sequences of 16 tokens, batch 4, Adam written with
``jax.tree.map``; the task is to name the token before the current one (attention
to the previous position is the only way to it).
"""

from __future__ import annotations

import numpy as np
import pytest
from jaxcases import jax_backend

import portattn
from portattn import masks
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")

VOCAB, D_MODEL, HEADS, SEQ, BATCH, LAYERS, STEPS = 12, 32, 2, 16, 4, 2, 50


def _attention(impl):
    def attend(q, k, v):  # (B, H, L, Dh)
        if impl == "jax":
            out = jax.nn.dot_product_attention(*(jnp.swapaxes(a, 1, 2) for a in (q, k, v)),
                                               is_causal=True)
            return jnp.swapaxes(out, 1, 2)
        return portattn.attention(q, k, v, mask=masks.causal(), kernel=impl)

    return attend


def _init(seed):
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 4 * LAYERS))

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) / np.sqrt(n_in)

    layers = [{"qkv": dense(D_MODEL, 3 * D_MODEL), "out": dense(D_MODEL, D_MODEL),
               "up": dense(D_MODEL, 2 * D_MODEL), "down": dense(2 * D_MODEL, D_MODEL)}
              for _ in range(LAYERS)]
    return {"embed": dense(VOCAB, D_MODEL), "pos": dense(SEQ, D_MODEL) * 0.1,
            "head": dense(D_MODEL, VOCAB), "layers": layers}


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def _loss(params, tokens, attend):
    x = params["embed"][tokens] + params["pos"]
    b, n, _ = x.shape
    for layer in params["layers"]:
        qkv = _norm(x) @ layer["qkv"]
        q, k, v = (jnp.swapaxes(a.reshape(b, n, HEADS, -1), 1, 2)
                   for a in jnp.split(qkv, 3, axis=-1))
        heads = jnp.swapaxes(attend(q, k, v), 1, 2).reshape(b, n, D_MODEL)
        x = x + heads @ layer["out"]
        x = x + jax.nn.gelu(_norm(x) @ layer["up"]) @ layer["down"]
    logits = _norm(x) @ params["head"]
    logp = jax.nn.log_softmax(logits[:, 1:])
    nll = -jnp.take_along_axis(logp, tokens[:, :-1, None], axis=-1)[..., 0]
    return nll.mean()


def _batches(seed):
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        yield jnp.asarray(rng.integers(0, VOCAB, size=(BATCH, SEQ)), jnp.int32)


def _train(impl):
    attend = _attention(impl)
    params = _init(0)
    moments = jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params)

    @jax.jit
    def step(params, moments, tokens, t):
        loss, grads = jax.value_and_grad(_loss)(params, tokens, attend)
        m, v = moments
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)
        lr = 1e-2 * jnp.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        params = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8), params, m, v)
        return params, (m, v), loss

    losses = []
    for t, tokens in enumerate(_batches(1), start=1):
        params, moments, loss = step(params, moments, tokens, t)
        losses.append(float(loss))
    return np.array(losses)


@pytest.fixture(scope="module")
def jax_curve():
    jax_backend()
    return _train("jax")


@pytest.mark.parametrize("impl", [None, "jax_flash"], ids=["dispatch", "jax_flash"])
def test_loss_curve_matches_jax(jax_curve, impl):
    curve = _train(impl)
    assert jax_curve[-5:].mean() < 0.8 * jax_curve[0], "the model must learn something"
    np.testing.assert_allclose(curve, jax_curve, rtol=2e-4, atol=2e-4)
