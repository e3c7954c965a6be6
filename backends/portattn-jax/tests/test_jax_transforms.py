"""``portattn.attention`` under ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

``tiled`` runs in float64 and its gradients (the core's flash backward, wired in by
``portattn_jax.attach_autograd``) are checked against finite differences; ``jax_dpa``
(float32 only) is checked against those float64 gradients. Without a kernel name,
dispatch chooses (``jax_flash`` for float64, ``jax_dpa`` for small float32 calls).
"""

from __future__ import annotations

import numpy as np
import pytest
from jaxcases import MASK_NAMES, Shapes, arrays, jax_backend, mask_pair
from portattn_jax import register_mask_pytrees

import portattn
from portattn.testing import assert_close, oracle
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")
from jax.test_util import check_grads  # noqa: E402

#: (kernel, dtype): the kernels that must survive tracing, each in a dtype it runs.
RUNS = [("jax_dpa", "float32"), ("tiled", "float64"), (None, "float64"), (None, "float32")]
RUN_IDS = ["jax_dpa-float32", "tiled-float64", "dispatch-float64", "dispatch-float32"]
CROSS = Shapes(lq=7, lk=9)
GRAD_MASKS = ("none", "causal", "window", "causal_and_key_lengths", "query_lengths", "dense",
              "bias")


@pytest.fixture(autouse=True)
def _jax():
    jax_backend()
    register_mask_pytrees()  # masks are arguments of jitted and vmapped functions here


#: Every mask through both kernels; dispatch (which picks one of them) on a few.
JIT_CASES = [(*run, m) for run in RUNS[:2] for m in MASK_NAMES] + [
    (*run, m) for run in RUNS[2:] for m in ("causal_and_key_lengths", "dense")]
JIT_IDS = [f"{rid}-{m}" for rid in RUN_IDS[:2] for m in MASK_NAMES] + [
    f"{rid}-{m}" for rid in RUN_IDS[2:] for m in ("causal_and_key_lengths", "dense")]


@pytest.mark.parametrize(("kernel", "dtype", "mask_name"), JIT_CASES, ids=JIT_IDS)
def test_jit_matches_reference(kernel, dtype, mask_name):
    (q, k, v), np_args = arrays(CROSS, dtype)
    mask, np_mask = mask_pair(mask_name, CROSS)
    attend = jax.jit(lambda q, k, v: portattn.attention(q, k, v, mask=mask, kernel=kernel))
    want, _, _ = oracle(*np_args, mask=np_mask)
    assert_close(attend(q, k, v), want, dtype)


@pytest.mark.parametrize(("kernel", "dtype"), RUNS, ids=RUN_IDS)
def test_mask_as_jit_argument(kernel, dtype):
    (q, k, v), np_args = arrays(CROSS, dtype)
    attend = jax.jit(lambda q, k, v, m: portattn.attention(q, k, v, mask=m, kernel=kernel))
    for seed in (1, 2):  # the same compiled function, new lengths
        mask, np_mask = mask_pair("causal_and_key_lengths", CROSS, seed=seed)
        want, _, _ = oracle(*np_args, mask=np_mask)
        assert_close(attend(q, k, v, mask), want, dtype)


@pytest.mark.parametrize("mask_name", GRAD_MASKS)
def test_tiled_grad_matches_finite_differences(mask_name):
    shapes = Shapes(batch=(2,), hq=2, hkv=1, lq=5, lk=6, d=4, dv=3)
    (q, k, v), _ = arrays(shapes, "float64")
    mask, _ = mask_pair("none" if mask_name == "bias" else mask_name, shapes)
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((shapes.hq, 5, 6)))

    def attend(q, k, v, bias):
        # check_grads evaluates at NumPy points; the mask's arrays are JAX ones
        q, k, v, bias = (jnp.asarray(a) for a in (q, k, v, bias))
        return portattn.attention(q, k, v, mask=mask, kernel="tiled",
                                  bias=bias if mask_name == "bias" else None)

    # Reverse mode only: the wiring is a jax.custom_vjp, which JAX cannot push forward.
    check_grads(jax.jit(attend), (q, k, v, bias), order=1, modes=("rev",))


@pytest.mark.parametrize("mask_name", GRAD_MASKS)
def test_jax_dpa_grad_matches_tiled_float64(mask_name):
    shapes = Shapes(batch=(2,), hq=4, hkv=2, lq=7, lk=9, d=8, dv=8)
    (q, k, v), _ = arrays(shapes, "float32")
    q64, k64, v64 = (a.astype(jnp.float64) for a in (q, k, v))
    mask, _ = mask_pair("none" if mask_name == "bias" else mask_name, shapes)
    bias = None
    if mask_name == "bias":
        bias = jnp.asarray(np.random.default_rng(3).standard_normal((4, 7, 9)), jnp.float32)
    weights = jnp.asarray(np.random.default_rng(4).standard_normal((2, 4, 7, 8)))

    def loss(kernel, q, k, v, bias):
        out = portattn.attention(q, k, v, mask=mask, bias=bias, kernel=kernel)
        return jnp.sum(out * weights.astype(out.dtype))

    argnums = (1, 2, 3, 4) if bias is not None else (1, 2, 3)
    got = jax.jit(jax.grad(loss, argnums), static_argnums=0)("jax_dpa", q, k, v, bias)
    bias64 = None if bias is None else bias.astype(jnp.float64)
    want = jax.grad(loss, argnums)("tiled", q64, k64, v64, bias64)
    for name, g, w in zip(("query", "key", "value", "bias"), got, want, strict=False):
        assert g.dtype == jnp.float32, f"d{name} dtype {g.dtype}"
        assert_close(g, np.asarray(w), "float32", f"d{name}")


@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize(("kernel", "dtype"), RUNS[:2], ids=RUN_IDS[:2])
def test_vmap_over_batch(kernel, dtype, mask_name):
    (q, k, v), np_args = arrays(CROSS, dtype)
    mask, np_mask = mask_pair(mask_name, CROSS)

    def one(q, k, v, m):  # one batch element: (H, L, D), lengths of shape ()
        return portattn.attention(q, k, v, mask=m, kernel=kernel)

    got = jax.vmap(one)(q, k, v, mask)
    want, _, _ = oracle(*np_args, mask=np_mask)
    assert_close(got, want, dtype)


@pytest.mark.parametrize(("kernel", "dtype"), RUNS[:2], ids=RUN_IDS[:2])
def test_vmap_of_grad(kernel, dtype):
    (q, k, v), _ = arrays(CROSS, dtype)

    def loss(q, k, v):
        return jnp.sum(portattn.attention(q, k, v, mask=portattn.masks.causal(),
                                          kernel=kernel) ** 2)

    per_example = jax.vmap(jax.grad(loss))(q, k, v)
    whole = jax.grad(loss)(q, k, v)  # the loss is a sum over batch elements
    assert_close(per_example, np.asarray(whole, dtype=np.float64), dtype, "dquery")
