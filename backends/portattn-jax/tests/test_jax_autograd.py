"""What the plugin adds for JAX's autograd (entry point ``portattn.libraries:jax``): the
``tiled`` kernel differentiated with the core's flash backward, checked against the
float64 textbook gradients."""

from __future__ import annotations

from importlib.metadata import entry_points

import numpy as np
import pytest
from jaxcases import Shapes, arrays, jax_backend
from portattn_jax import _autograd, attach_autograd, register_mask_pytrees

import portattn
from portattn import masks
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")
autograd = require_library("portattn.autograd")
from textbook import allowed_of, textbook, weighted_loss  # noqa: E402


@pytest.fixture(autouse=True)
def _jax():
    jax_backend()
    register_mask_pytrees()


@pytest.fixture
def backward_calls(monkeypatch):
    """Counts the core's flash backward as the wiring calls it."""
    calls = []
    original = autograd.flash_backward

    def counting(*args, **kwargs):
        calls.append(kwargs.get("bias_grad"))
        return original(*args, **kwargs)

    monkeypatch.setattr(autograd, "flash_backward", counting)
    monkeypatch.setattr(_autograd, "_cache", [])  # rebuilt with the counting backward
    return calls


def test_entry_point_is_registered():
    found = [ep for ep in entry_points(group="portattn.libraries") if ep.name == "jax"]
    assert len(found) == 1
    assert found[0].load().attach_autograd is attach_autograd


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_tiled_gradients_use_the_flash_backward(backward_calls, with_bias):
    shapes = Shapes(batch=(2,), hq=4, hkv=2, lq=7, lk=9, d=8, dv=5)
    (q, k, v), (q64, k64, v64) = arrays(shapes, "float64")
    rng = np.random.default_rng(2)
    bias64 = rng.standard_normal((4, 7, 9)) if with_bias else None
    bias = None if bias64 is None else jnp.asarray(bias64)
    lengths = np.array([9, 4])
    mask = masks.causal() & masks.key_lengths(jnp.asarray(lengths))
    allowed = allowed_of(masks.causal() & masks.key_lengths(lengths), (2,), 4, 7, 9)
    w_out, w_lse = rng.standard_normal((2, 4, 7, 5)), rng.standard_normal((2, 4, 7))

    def loss(q, k, v, bias, mask):
        out, lse = portattn.attention(q, k, v, mask=mask, bias=bias, softcap=3.0,
                                      return_lse=True, kernel="tiled")
        return weighted_loss(out, lse, w_out, w_lse)

    def reference(q, k, v, bias):
        out, lse = textbook(q, k, v, allowed=allowed, bias=bias, softcap=3.0)
        return weighted_loss(out, lse, w_out, w_lse)

    argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    got = jax.jit(jax.grad(loss, argnums))(q, k, v, bias, mask)
    want = jax.grad(reference, argnums)(*(jnp.asarray(a) for a in (q64, k64, v64)), bias)
    assert backward_calls == [with_bias]
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want, strict=False):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-10,
                                   err_msg=name)


def test_bias_that_is_not_differentiated_gets_no_gradient_pass(backward_calls):
    (q, k, v), _ = arrays(Shapes(), "float32")
    bias = jnp.zeros((4, 7, 9), jnp.float32)

    def loss(q, bias):
        return jnp.sum(portattn.attention(q, k, v, bias=bias, kernel="tiled"))

    dq = jax.grad(loss)(q, bias)
    assert dq.dtype == jnp.float32
    assert backward_calls == [False]


def test_half_precision_gradients_keep_the_input_dtype():
    (q, k, v), _ = arrays(Shapes(), "bfloat16")

    def loss(q, k, v):
        return jnp.sum(portattn.attention(q, k, v, mask=masks.causal(), kernel="tiled")
                       .astype(jnp.float32))

    for g in jax.grad(loss, (0, 1, 2))(q, k, v):
        assert g.dtype == jnp.bfloat16
        assert np.isfinite(np.asarray(g.astype(jnp.float32))).all()
