"""Gradients under vmap: torch.func's batched gradients and jax.vmap of jax.grad, on
every kernel that computes gradients."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.errors import KernelNotUsableError
from portattn.testing.plugin import require_library


def _grad_kernels(namespace):
    return [e.name for e in portattn.kernels() if e.kernel is not None and e.kernel.grad
            and (e.kernel.namespaces == "*" or namespace in e.kernel.namespaces)]


# torch's SDPA backward has no batching rule yet: torch loops over the batch, and says so
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_torch_func_vmap_of_the_backward_on_every_kernel():
    torch = require_library("torch")
    rng = np.random.default_rng(0)
    q, k, v = (torch.tensor(rng.standard_normal(s), requires_grad=True)
               for s in [(2, 4, 7, 8), (2, 2, 9, 8), (2, 2, 9, 8)])
    cotangents = torch.tensor(rng.standard_normal((3, 2, 4, 7, 8)))
    ran = []
    for name in _grad_kernels("torch"):
        try:
            out = portattn.attention(q, k, v, mask=masks.causal(), kernel=name)
        except KernelNotUsableError:
            continue
        ran.append(name)

        def vjp(cotangent, out=out):
            return torch.autograd.grad(out, (q, k, v), cotangent, retain_graph=True)

        batched = torch.func.vmap(vjp)(cotangents)
        one_by_one = [vjp(c) for c in cotangents]
        for i, got in enumerate(batched):
            torch.testing.assert_close(got, torch.stack([g[i] for g in one_by_one]),
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert "tiled" in ran


def test_jax_vmap_of_grad_on_every_kernel():
    jax = require_library("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in [(3, 2, 4, 7, 8), (3, 2, 2, 9, 8), (3, 2, 2, 9, 8)])
    ran = []
    for name in _grad_kernels("jax"):

        def loss(q, k, v, name=name):
            out = portattn.attention(q, k, v, mask=masks.causal(), kernel=name)
            return jnp.sum(jnp.sin(out))

        try:
            batched = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        except KernelNotUsableError:
            continue
        ran.append(name)
        for i in range(3):
            one = jax.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i])
            for got, want in zip(batched, one, strict=True):
                np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), rtol=2e-5,
                                           atol=2e-5, err_msg=name)
    assert "tiled" in ran



@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("tiles", ["whole", "small"])
def test_torch_gradcheck_with_batched_gradients_on_every_kernel(tiles, monkeypatch):
    """``gradcheck(check_batched_grad=True)`` vmaps the backward with torch's legacy
    batching, which has no rule for an alias (a slice of a whole axis) nor for
    ``swapaxes``."""
    torch = require_library("torch")
    if tiles == "small":  # several query and key blocks: the slices are partial
        import portattn._kernels._tiled as tiled

        for name, value in (("MAX_BLOCK_K", 4), ("MIN_BLOCK_Q", 2), ("TILE_ELEMENTS", 16)):
            monkeypatch.setattr(tiled, name, value)
    rng = np.random.default_rng(2)
    q, k, v = (torch.tensor(rng.standard_normal(s), requires_grad=True)
               for s in [(1, 4, 6, 3), (1, 2, 9, 3), (1, 2, 9, 3)])
    bias = torch.tensor(rng.standard_normal((1, 4, 6, 9)), requires_grad=True)
    mask = masks.causal() & masks.key_lengths(torch.tensor([7]))
    calls = {
        "masked": (lambda q, k, v: portattn.attention(q, k, v, mask=mask), (q, k, v)),
        "bias, softcap": (lambda q, k, v, b: portattn.attention(q, k, v, bias=b, softcap=2.0),
                          (q, k, v, bias)),
    }
    ran = []
    for name in _grad_kernels("torch"):
        for what, (call, args) in calls.items():
            with portattn.use_kernel(name):
                try:
                    call(*args)
                except KernelNotUsableError:
                    continue
                assert torch.autograd.gradcheck(call, args, check_batched_grad=True), (
                    name, what)
            ran.append((name, what))
    assert {("tiled", "masked"), ("tiled", "bias, softcap")} <= set(ran)
