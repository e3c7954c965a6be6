"""Borrowing: other libraries' arrays run through torch without copies."""

from __future__ import annotations

import numpy as np
import pytest

from portattn.testing.plugin import require_library

torch = require_library("torch")
pytestmark = pytest.mark.cross  # NumPy (and JAX) arrays borrowed into torch

from portattn_torch import TorchSDPADLPackKernel  # noqa: E402
from portattn_torch._dlpack_kernel import borrow, give_back  # noqa: E402

import portattn  # noqa: E402
from portattn import masks  # noqa: E402
from portattn.testing import assert_close, oracle  # noqa: E402

F = torch.nn.functional
SDPA = F.scaled_dot_product_attention


def _qkv(lq=6, lk=9, dtype=np.float32):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(s).astype(dtype)
                 for s in ((2, 4, lq, 8), (2, 2, lk, 8), (2, 2, lk, 8)))


@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []

    def spy(q, k, v, **kwargs):
        out = SDPA(q, k, v, **kwargs)
        calls.append({"query": q, "key": k, "value": v, "out": out, **kwargs})
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def _address(a):
    return a.__array_interface__["data"][0]


def test_numpy_inputs_and_output_are_not_copied(sdpa_calls):
    q, k, v = _qkv()
    out = portattn.attention(q, k, v, kernel="torch_sdpa_dlpack")
    (call,) = sdpa_calls
    for name, array in (("query", q), ("key", k), ("value", v)):
        assert call[name].data_ptr() == _address(array), f"{name} was copied"
    assert type(out) is np.ndarray
    assert np.shares_memory(out, call["out"].numpy())
    assert_close(out, oracle(q, k, v)[0], "float32")


def test_strided_views_are_borrowed_in_place(sdpa_calls):
    q, k, v = _qkv()
    wide = np.concatenate([k, k], axis=-1)
    k_view = wide[..., ::2]  # non-contiguous
    portattn.attention(q, k_view, v, kernel="torch_sdpa_dlpack")
    assert sdpa_calls[0]["key"].data_ptr() == _address(k_view)
    assert sdpa_calls[0]["key"].stride()[-1] == 2


def test_reversed_views_are_copied_not_crashed():
    q, k, v = _qkv()
    k_rev = k[..., ::-1, :]
    out = portattn.attention(q, k_rev, v, kernel="torch_sdpa_dlpack")
    assert_close(out, oracle(q, k_rev, v)[0], "float32")


def test_read_only_arrays_are_borrowed():
    q, k, v = _qkv()
    for a in (q, k, v):
        a.flags.writeable = False
    out = portattn.attention(q, k, v, mask=masks.causal(), kernel="torch_sdpa_dlpack")
    assert_close(out, oracle(q, k, v, mask=masks.causal())[0], "float32")


def test_mask_and_bias_arrays_are_borrowed(sdpa_calls):
    q, k, v = _qkv(lq=9)
    allowed = np.random.default_rng(1).random((4, 9, 9)) < 0.7
    lengths = np.array([9, 4])
    bias = np.random.default_rng(2).standard_normal((9, 9)).astype(np.float32)
    mask = masks.dense(allowed) & masks.key_lengths(lengths)
    out = portattn.attention(q, k, v, mask=mask, bias=bias, kernel="torch_sdpa_dlpack")
    assert sdpa_calls[0]["attn_mask"].dtype == torch.float32
    assert_close(out, oracle(q, k, v, mask=mask, bias=bias)[0], "float32")


def test_round_trip_shares_memory():
    a = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    t = borrow(a)
    assert t.data_ptr() == _address(a)
    back = give_back(t, np)
    assert np.shares_memory(back, a)


def test_jax_round_trip():
    jax = require_library("jax")
    jnp = jax.numpy
    x = jnp.arange(12.0).reshape(3, 4)
    t = borrow(x)
    assert t.data_ptr() == x.unsafe_buffer_pointer()
    back = give_back(t * 2, jnp)
    assert isinstance(back, jax.Array)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x) * 2)


def test_traced_jax_arrays_are_declined():
    jax = require_library("jax")
    q, k, v = (jax.numpy.asarray(a) for a in _qkv())
    seen = []

    def f(q, k, v):
        seen.append(portattn.explain(q, k, v))
        return q

    jax.jit(f)(q, k, v)
    why = dict((e.name, r) for e, r in seen[0].candidates)["torch_sdpa_dlpack"]
    assert "traced jax arrays (jit, grad, vmap) cannot be borrowed" in why


def test_gradients_and_dropout_are_not_offered():
    q, k, v = _qkv()
    plan = portattn.explain(q, k, v, dropout_p=0.1, dropout_seed=0)
    why = dict((e.name, r) for e, r in plan.candidates)["torch_sdpa_dlpack"]
    assert "dropout_p=0.1 not supported" in why
    assert not TorchSDPADLPackKernel.grad
