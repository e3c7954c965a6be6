"""layout="blhd": arrays held as (..., length, heads, head_dim), on every kernel."""

from __future__ import annotations

import numpy as np
import pytest
from fuzz_oracle import attention64

import portattn
from portattn import masks
from portattn.errors import KernelNotUsableError
from portattn.kernel import ANY
from portattn.testing import tolerance
from portattn.testing.plugin import require_library


def _blhd(backend, lq=9, lk=11, hq=4, hkv=2, seed=0):
    """q, k, v laid out (B, L, H, D) on the backend, and as float64 (B, H, L, D)."""
    rng = np.random.default_rng(seed)
    held = [rng.standard_normal(s) for s in [(2, lq, hq, 8), (2, lk, hkv, 8), (2, lk, hkv, 8)]]
    arrays = tuple(backend.asarray(a, "float32") for a in held)
    return arrays, [np.asarray(backend.to_numpy(a), np.float64).transpose(0, 2, 1, 3)
                    for a in arrays]


def test_every_kernel_reads_and_writes_blhd(backend):
    (q, k, v), seen = _blhd(backend)
    lengths = backend.asarray(np.array([11, 6]))
    mask = masks.causal() & masks.key_lengths(lengths)
    allowed = (np.arange(11) <= np.arange(9)[:, None] + 2) & (
        np.arange(11) < np.array([11, 6])[:, None, None, None])
    want, want_lse = attention64(*seen, np.broadcast_to(allowed, (2, 4, 9, 11)), None, None, None)
    rtol, atol = tolerance("float32")
    ran, wrong = [], []
    for entry in portattn.kernels():
        if entry.kernel is None or not (entry.kernel.namespaces == ANY
                                        or backend.namespace in entry.kernel.namespaces):
            continue
        try:
            out, lse = portattn.attention(q, k, v, mask=mask, layout="blhd", return_lse=True,
                                          kernel=entry.name)
        except KernelNotUsableError:
            continue
        ran.append(entry.name)
        got = np.asarray(backend.to_numpy(out), np.float64)
        if got.shape != (2, 9, 4, 8) or not np.allclose(got.transpose(0, 2, 1, 3), want,
                                                        rtol=rtol, atol=atol):
            wrong.append(f"{entry.name}: out {got.shape}")
        got_lse = np.asarray(backend.to_numpy(lse), np.float64)
        if got_lse.shape != (2, 4, 9) or not np.allclose(got_lse, want_lse, rtol=rtol, atol=atol):
            wrong.append(f"{entry.name}: lse {got_lse.shape}")
    assert not wrong, wrong
    assert len(ran) >= 2, ran


def test_blhd_arrays_reach_the_kernel_as_views():
    q = np.zeros((2, 16, 4, 8), np.float32)
    k = np.zeros((2, 16, 2, 8), np.float32)
    inputs = portattn.explain(q, k, k, layout="blhd").inputs
    assert (inputs.query.shape, inputs.key.shape) == ((2, 4, 16, 8), (2, 2, 16, 8))
    assert np.shares_memory(inputs.query, q)
    assert np.shares_memory(inputs.key, k)


def test_blhd_views_on_torch_and_their_gradients():
    torch = require_library("torch")
    rng = np.random.default_rng(1)
    q, k, v = (torch.tensor(rng.standard_normal(s), dtype=torch.float64, requires_grad=True)
               for s in [(2, 7, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)])
    inputs = portattn.explain(q, k, v, layout="blhd").inputs
    assert inputs.query.data_ptr() == q.data_ptr()
    out = portattn.attention(q, k, v, mask=masks.causal(), layout="blhd")
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    moved = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    want = portattn.attention(*moved, mask=masks.causal()).transpose(1, 2)
    want_grads = torch.autograd.grad((want * want).sum(), moved)
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected.transpose(1, 2))


def test_blhd_gradients_on_jax():
    jax = require_library("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in [(2, 7, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)])

    def loss(q, k, v, layout):
        moved = (q, k, v) if layout == "blhd" else (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
        out = portattn.attention(*moved, mask=masks.causal(), layout=layout)
        return jnp.sum(jnp.sin(out if layout == "blhd" else jnp.swapaxes(out, 1, 2)))

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, "blhd")
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "bhld")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_layout_errors_name_the_layout_and_the_shapes_as_passed():
    q = np.zeros((2, 16, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"layout must be one of 'bhld', 'blhd'; got "
                                         r"layout='bshd'"):
        portattn.attention(q, q, q, layout="bshd")
    with pytest.raises(ValueError, match=r"query heads must be a multiple of key/value heads "
                                         r"\(grouped-query\); got query.shape\[-2\]=4, "
                                         r"key.shape\[-2\]=3$"):
        portattn.attention(q, *[np.zeros((2, 16, 3, 8), np.float32)] * 2, layout="blhd")
    with pytest.raises(ValueError, match=r"key.shape=\(2, 16, 4, 8\), value.shape=\(2, 15, 4, 8\)"):
        portattn.attention(q, q, np.zeros((2, 15, 4, 8), np.float32), layout="blhd")
    with pytest.raises(ValueError, match=r"query must have shape \(\.\.\., length, heads, "
                                         r"head_dim\) with at least 3 dims"):
        portattn.attention(np.zeros((4, 8), np.float32), q, q, layout="blhd")


def test_arrays_held_the_other_way_get_a_hint():
    q = np.zeros((2, 16, 4, 8), np.float32)  # (B, Lq, H, D)
    k = np.zeros((2, 12, 2, 8), np.float32)  # (B, Lk, Hkv, D)
    with pytest.raises(ValueError, match=r"query.shape\[-3\]=16, key.shape\[-3\]=12; for "
                                         r"\(\.\.\., length, heads, head_dim\) arrays pass "
                                         r"layout='blhd'"):
        portattn.attention(q, k, k)
    assert portattn.attention(q, k, k, layout="blhd").shape == (2, 16, 4, 8)
