"""Linear attention against a direct O(L^2) evaluation of the same formula."""

from __future__ import annotations

import numpy as np
import pytest

from portattn.linear import linear_attention
from portattn.testing import assert_close


def elu_plus_one(x):
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def quadratic(q, k, v, *, causal=False, phi=elu_plus_one):
    """``sum_j s_ij v_j / sum_j s_ij`` with ``s_ij = phi(q_i) . phi(k_j)``, float64."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    s = phi(q) @ np.swapaxes(phi(k), -1, -2)
    if causal:
        lq, lk = q.shape[-2], k.shape[-2]
        s = s * (np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq))
    return (s @ v) / s.sum(axis=-1, keepdims=True)


def make(rng, *shape):
    return rng.standard_normal(shape)


@pytest.mark.parametrize(("causal", "chunk_size", "num_kv_heads"),
                         [(False, 64, 4), (False, 64, 2), (True, 1, 4), (True, 4, 2),
                          (True, 64, 1)])
def test_matches_quadratic_formula(backend, causal, chunk_size, num_kv_heads):
    rng = np.random.default_rng(0)
    q, k, v = make(rng, 2, 4, 13, 8), make(rng, 2, num_kv_heads, 13, 8), \
        make(rng, 2, num_kv_heads, 13, 6)
    out = linear_attention(*(backend.asarray(a, "float32") for a in (q, k, v)),
                           causal=causal, chunk_size=chunk_size)
    assert_close(out, quadratic(q, k, v, causal=causal), "float32")


@pytest.mark.parametrize(("lq", "lk"), [(5, 13), (1, 9)])
def test_causal_is_bottom_right_aligned(backend, lq, lk):
    rng = np.random.default_rng(1)
    q, k, v = make(rng, 1, 2, lq, 4), make(rng, 1, 2, lk, 4), make(rng, 1, 2, lk, 4)
    out = linear_attention(*(backend.asarray(a, "float32") for a in (q, k, v)),
                           causal=True, chunk_size=2)
    assert_close(out, quadratic(q, k, v, causal=True), "float32")


def test_callable_feature_map_may_change_the_feature_size(backend):
    xp = backend.xp
    rng = np.random.default_rng(2)
    q, k, v = make(rng, 3, 10, 4), make(rng, 3, 10, 4), make(rng, 3, 10, 5)

    def phi(t):
        return xp.concat([xp.exp(t), xp.exp(-t)], axis=-1)

    def phi_np(t):
        return np.concatenate([np.exp(t), np.exp(-t)], axis=-1)

    args = [backend.asarray(a, "float32") for a in (q, k, v)]
    for causal in (False, True):
        out = linear_attention(*args, causal=causal, feature_map=phi, chunk_size=3)
        assert_close(out, quadratic(q, k, v, causal=causal, phi=phi_np), "float32",
                     f"causal={causal}")


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_dtypes(backend, dtype):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    rng = np.random.default_rng(3)
    q, k, v = (rng.uniform(-1, 1, (2, 9, 8)) for _ in range(3))
    args = [backend.asarray(a, dtype) for a in (q, k, v)]
    out = linear_attention(*args, causal=True, chunk_size=4)
    assert out.dtype == args[0].dtype
    expected = quadratic(*(backend.to_numpy(a) for a in args), causal=True)
    assert_close(out, expected, dtype)


def test_no_keys_gives_zeros(backend):
    q = backend.asarray(np.ones((2, 3, 4)), "float32")
    kv = backend.asarray(np.ones((2, 0, 4)), "float32")
    out = backend.to_numpy(linear_attention(q, kv, kv))
    assert out.shape == (2, 3, 4)
    assert not out.any()


def test_bad_arguments(backend):
    q = backend.asarray(np.ones((2, 5, 4)), "float32")
    kv = backend.asarray(np.ones((2, 3, 4)), "float32")
    with pytest.raises(ValueError, match=r"feature_map=.relu."):
        linear_attention(q, q, q, feature_map="relu")
    with pytest.raises(ValueError, match=r"Lq <= Lk.*query.shape\[-2\]=5, key.shape\[-2\]=3"):
        linear_attention(q, kv, kv, causal=True)
    with pytest.raises(ValueError, match=r"chunk_size=0"):
        linear_attention(q, q, q, causal=True, chunk_size=0)
    odd = backend.asarray(np.ones((3, 5, 4)), "float32")
    with pytest.raises(ValueError, match=r"multiple of key/value heads"):
        linear_attention(backend.asarray(np.ones((2, 5, 4)), "float32"), odd, odd)
    xp = backend.xp
    with pytest.raises(ValueError, match=r"feature_map must map"):
        linear_attention(q, q, q, feature_map=lambda t: xp.sum(t, axis=-2))


def test_other_library_is_rejected(backend):
    other = pytest.importorskip("array_api_strict" if backend.name == "numpy" else "numpy")
    q = backend.asarray(np.ones((2, 5, 4)), "float32")
    foreign = other.asarray(np.ones((2, 5, 4), dtype=np.float32))
    with pytest.raises(TypeError, match=r"one array library"):
        linear_attention(q, foreign, foreign)
