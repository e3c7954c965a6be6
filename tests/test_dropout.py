"""Dropout drawn from a seed: the same pairs in every kernel and library, forward and
backward, at the rate asked; bad seeds refused by name. (Each kernel's output against
the oracle given the same seed is in the conformance kit's ``dropout`` cases.)"""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import dropout, masks
from portattn.testing.plugin import require_library


def _qkv(shape=(2, 4, 48, 8), kv_heads=2, seed=0):
    rng = np.random.default_rng(seed)
    b, _, length, d = shape
    return (rng.standard_normal(shape), rng.standard_normal((b, kv_heads, length, d)),
            rng.standard_normal((b, kv_heads, length, d)))


def test_the_rate_and_the_independence_of_rows_heads_and_positions():
    q, k, _ = _qkv((4, 8, 128, 4), kv_heads=8)
    for p in (0.1, 0.5, 0.9):
        kept = dropout.mask(q, k, dropout_p=p, dropout_seed=123)
        assert kept.shape == (4, 8, 128, 128)
        # 524288 pairs: the binomial's standard deviation is below 0.0007
        assert abs(kept.mean() - (1 - p)) < 0.004, (p, kept.mean())
        x = kept.reshape(32, -1).astype(np.float64)
        corr = np.corrcoef(x)[np.triu_indices(32, 1)]
        assert np.abs(corr).max() < 0.03  # rows (batch, head) drawn independently
        shifted = np.mean(kept[..., 1:, :] == kept[..., :-1, :])  # neighbouring queries
        assert abs(shifted - (p * p + (1 - p) ** 2)) < 0.005
    assert not np.array_equal(dropout.mask(q, k, dropout_p=0.5, dropout_seed=1),
                              dropout.mask(q, k, dropout_p=0.5, dropout_seed=2))


def test_seeds_given_as_ints_or_words_are_one_seed():
    q, k, _ = _qkv()
    big = (7 << 32) + 5
    same = [dropout.mask(q, k, dropout_p=0.3, dropout_seed=s) for s in (
        big, np.asarray([5, 7], np.uint32), np.asarray([big], np.int64),
        np.asarray([[5], [7]], np.int32), np.asarray(big, np.uint64))]
    for m in same[1:]:
        np.testing.assert_array_equal(m, same[0])
    high = dropout.mask(q, k, dropout_p=0.3, dropout_seed=np.asarray([0xFFFFFFFF], np.uint32))
    np.testing.assert_array_equal(high, dropout.mask(q, k, dropout_p=0.3, dropout_seed=-1))


def test_a_tile_is_the_slice_of_the_whole_mask():
    q, k, _ = _qkv()
    inputs = portattn.explain(q, k, k, dropout_p=0.4, dropout_seed=9).inputs
    word = dropout.seed_word(inputs)
    whole = dropout.tile(inputs, word, 0, 48, 0, 48)
    np.testing.assert_array_equal(dropout.tile(inputs, word, 5, 17, 30, 41),
                                  whole[..., 5:17, 30:41])


@pytest.mark.parametrize("mask", [None, "causal", "documents"])
def test_the_output_is_the_dropped_weights_times_the_values(xp, backend, mask):
    q, k, v = _qkv()
    ids = np.repeat([[0, 1, 2], [0, 0, 1]], 16, axis=1)

    def made(convert):
        return {None: None, "causal": masks.causal(),
                "documents": masks.causal() & masks.documents(convert(ids))}[mask]

    kept = dropout.mask(q, k, dropout_p=0.25, dropout_seed=77)
    weights = portattn.attention(q, k, v, mask=made(np.asarray), kernel="reference",
                                 return_weights=True)[1]
    want = (weights * kept / 0.75) @ np.repeat(v, 2, axis=1)
    args = [backend.asarray(a, "float64") for a in (q, k, v)]
    for kernel in ("tiled", "reference"):
        out = portattn.attention(*args, mask=made(backend.asarray), dropout_p=0.25,
                                 dropout_seed=77, kernel=kernel)
        np.testing.assert_allclose(backend.to_numpy(out), want, rtol=1e-10, atol=1e-12)


def test_no_dropout_without_a_probability_and_the_lse_before_dropout():
    q, k, v = _qkv()
    out, lse = portattn.attention(q, k, v, return_lse=True, kernel="tiled")
    same = portattn.attention(q, k, v, dropout_p=0.0, dropout_seed=3, kernel="tiled")
    np.testing.assert_array_equal(out, same)
    dropped, lse_dropped = portattn.attention(q, k, v, return_lse=True, dropout_p=0.5,
                                              dropout_seed=3, kernel="tiled")
    np.testing.assert_allclose(lse_dropped, lse, rtol=1e-12)
    assert not np.allclose(dropped, out)


def test_bad_seeds_are_refused_by_name():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dropout_p > 0 on numpy arrays needs dropout_seed"):
        portattn.attention(q, k, v, dropout_p=0.1)
    for seed, error, says in ((True, TypeError, "dropout_seed must be an int"),
                              (1.5, TypeError, "dropout_seed must be an array"),
                              (np.zeros(2), TypeError, "integer dtype; got dtype=float64"),
                              (np.zeros(5, np.int32), ValueError, "1 to 4 integers"),
                              (np.zeros(0, np.int32), ValueError, "got shape \\(0,\\)")):
        with pytest.raises(error, match=says):
            portattn.attention(q, k, v, dropout_p=0.1, dropout_seed=seed)


def _torch_grads(torch, kernel, q, k, v, bias, seed, mask):
    o, lse = portattn.attention(q, k, v, bias=bias, mask=mask, dropout_p=0.3,
                                dropout_seed=seed, return_lse=True, kernel=kernel)
    loss = (o * o).sum() + (lse * lse.detach()).sum()
    return (o, lse, *torch.autograd.grad(loss, (q, k, v, bias)))


@pytest.mark.parametrize("mask", [None, "causal"])
def test_torch_gradients_regenerate_the_forward_mask(mask):
    torch = require_library("torch", backend="torch")
    gen = torch.Generator().manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_()

    q, k, v, bias = make(2, 4, 70, 8), make(2, 2, 70, 8), make(2, 2, 70, 8), make(4, 70, 70)
    made = masks.causal() if mask else None
    # tiled saves (q, k, v, out, lse) and runs the flash backward; reference is
    # differentiated by torch through the materialised, dropped weights
    want = _torch_grads(torch, "reference", q, k, v, bias, 11, made)
    got = _torch_grads(torch, "tiled", q, k, v, bias, 11, made)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


def test_torch_draws_a_seed_from_its_generator_when_none_is_given():
    torch = require_library("torch", backend="torch")
    q = torch.randn(1, 2, 64, 8, dtype=torch.float64)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(portattn.attention(q, q, q, dropout_p=0.5, kernel="tiled"))
    runs.append(portattn.attention(q, q, q, dropout_p=0.5, kernel="tiled"))
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    assert not torch.equal(runs[0], runs[2])


def test_torch_draws_the_same_mask_in_the_backward_without_a_seed():
    torch = require_library("torch", backend="torch")
    q = torch.randn(1, 2, 40, 8, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    out = portattn.attention(q, q, q, dropout_p=0.4, kernel="tiled")
    (grad,) = torch.autograd.grad(out.sum(), q)
    # the seed drawn after manual_seed(3), replayed by hand
    torch.manual_seed(3)
    plan = portattn.explain(q, q, q, dropout_p=0.4, kernel="tiled")
    words = dropout.seed_words(plan.inputs)
    want = portattn.attention(q, q, q, dropout_p=0.4, dropout_seed=words, kernel="reference")
    (want_grad,) = torch.autograd.grad(want.sum(), q)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-11)


def test_torch_sdpa_keeps_torch_dropout_and_refuses_a_seed():
    torch = require_library("torch", backend="torch")
    require_library("portattn_torch", backend="torch")
    q = torch.randn(1, 2, 16, 8)
    reasons = dict(portattn.explain(q, q, q, dropout_p=0.1, dropout_seed=1).candidates)
    sdpa = next(r for e, r in reasons.items() if e.name == "torch_sdpa")
    assert "dropout_seed not supported" in "; ".join(sdpa)
    assert portattn.explain(q, q, q, dropout_p=0.1).kernel.name == "torch_sdpa"


@pytest.mark.parametrize("kernel", ["reference", "tiled", "jax_flash"])
def test_jax_gradients_with_a_typed_key_under_jit(kernel):
    jax = require_library("jax", backend="jax")
    jnp = jax.numpy
    if kernel == "jax_flash":
        require_library("portattn_jax", backend="jax")
    q, k, v = (jnp.asarray(a, jnp.float32) for a in _qkv())
    ids = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], 16, axis=1))
    mask = masks.causal() & masks.documents(ids)
    key = jax.random.key(4)

    def loss(q, k, v, seed, kernel):
        o, lse = portattn.attention(q, k, v, mask=mask, dropout_p=0.3, dropout_seed=seed,
                                    return_lse=True, kernel=kernel)
        return jnp.sum(o * o) + jnp.sum(lse * jax.lax.stop_gradient(lse))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=4)
    got = grads(q, k, v, key, kernel)
    # the reference kernel, differentiated by JAX, given the key's words
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, jax.random.key_data(key), "reference")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def test_jax_needs_a_key():
    jax = require_library("jax", backend="jax")
    q = jax.numpy.zeros((1, 1, 4, 8))
    with pytest.raises(ValueError, match="on jax arrays needs dropout_seed"):
        portattn.attention(q, q, q, dropout_p=0.1)


@pytest.mark.cross
def test_every_library_draws_the_same_pairs():
    q, k, _ = _qkv()
    want = dropout.mask(q, k, dropout_p=0.35, dropout_seed=2**40 + 17)
    for name in ("torch", "jax"):
        lib = require_library(name)
        convert = lib.asarray if name == "torch" else lib.numpy.asarray
        got = dropout.mask(convert(q), convert(k), dropout_p=0.35, dropout_seed=2**40 + 17)
        np.testing.assert_array_equal(np.asarray(got), want)
