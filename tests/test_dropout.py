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
    np.testing.assert_array_equal(high, dropout.mask(q, k, dropout_p=0.3,
                                                     dropout_seed=0xFFFFFFFF))


_INTEGERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _integer_seeds(backend, value):
    """``value`` as NumPy integer scalars and as 0-d arrays of ``backend``, of every
    integer dtype that holds it (and that the library has)."""
    seeds = []
    for name in _INTEGERS:
        info = np.iinfo(name)
        if not info.min <= value <= info.max:
            continue
        seeds.append(np.asarray(value, name)[()])
        if hasattr(backend.xp, name):
            seeds.append(backend.asarray(np.asarray(value, name)))
    return seeds


def _mask_of(backend, seed, q, k, p=0.3):
    kept = dropout.mask(backend.asarray(q), backend.asarray(k), dropout_p=p, dropout_seed=seed)
    return backend.to_numpy(kept)


@pytest.mark.parametrize("value", [7, 2**31 + 3, 2**40 + 17])
def test_one_seed_value_is_one_mask_whatever_its_type(backend, value):
    q, k, _ = _qkv()
    want = dropout.mask(q, k, dropout_p=0.3, dropout_seed=value)
    seeds = _integer_seeds(backend, value)
    assert len(seeds) >= 4
    for seed in seeds:
        got = _mask_of(backend, seed, q, k)
        assert np.array_equal(got, want), (type(seed), getattr(seed, "dtype", None))


def test_negative_seeds_count_modulo_2_to_the_128(backend):
    q, k, _ = _qkv()
    want = dropout.mask(q, k, dropout_p=0.3, dropout_seed=-1)
    words = backend.asarray(np.full(4, 0xFFFFFFFF, np.uint32))
    same = [2**128 - 1, words, *_integer_seeds(backend, -1)]
    for seed in same:
        got = _mask_of(backend, seed, q, k)
        assert np.array_equal(got, want), (type(seed), getattr(seed, "dtype", None))
    assert not np.array_equal(want, dropout.mask(q, k, dropout_p=0.3, dropout_seed=0xFFFFFFFF))
    minus_five = dropout.mask(q, k, dropout_p=0.3, dropout_seed=-5)
    for seed in _integer_seeds(backend, -5):
        assert np.array_equal(_mask_of(backend, seed, q, k), minus_five)


def test_words_give_themselves_back():
    q, k, _ = _qkv()
    for seed in (7, -1, 2**127 + 9, np.asarray([3, 0], np.uint32)):
        inputs = portattn.explain(q, k, k, dropout_p=0.4, dropout_seed=seed).inputs
        words = dropout.seed_words(inputs)
        again = portattn.explain(q, k, k, dropout_p=0.4, dropout_seed=words).inputs
        np.testing.assert_array_equal(dropout.seed_words(again), words)
        np.testing.assert_array_equal(dropout.seed_word(again), dropout.seed_word(inputs))


def test_without_dropout_every_pair_is_kept(backend):
    q, k, _ = _qkv()
    kept = _mask_of(backend, 7, q, k, p=0.0)
    assert kept.shape == (2, 4, 48, 48)
    assert kept.all()


@pytest.mark.parametrize("p", [0.25, 0])
def test_dropout_p_is_any_real_number(backend, p):
    q, k, v = _qkv()
    args = [backend.asarray(a) for a in (q, k, v)]
    want = backend.to_numpy(portattn.attention(*args, dropout_p=float(p), dropout_seed=5))
    numbers = [np.float32(p), np.float16(p), np.float64(p), int(p) if p == 0 else p]
    for dropout_p in numbers:
        got = portattn.attention(*args, dropout_p=dropout_p, dropout_seed=5)
        np.testing.assert_array_equal(backend.to_numpy(got), want)
    scalar = backend.asarray(np.asarray(p, np.float32))
    if backend.namespace == "dask":  # lazy: its value is not known when the call is made
        with pytest.raises(ValueError, match=r"readable now; got dropout_p of type Array, lazy"):
            portattn.attention(*args, dropout_p=scalar, dropout_seed=5)
    else:
        got = portattn.attention(*args, dropout_p=scalar, dropout_seed=5)
        np.testing.assert_array_equal(backend.to_numpy(got), want)


@pytest.mark.parametrize(("dropout_p", "says"), [
    (1.0, "in \\[0, 1\\); got dropout_p=1.0"),
    (np.float32(-0.5), "in \\[0, 1\\); got dropout_p=np.float32\\(-0.5\\)"),
    (float("nan"), "got dropout_p=nan"),
    (True, "a real number, not a bool; got dropout_p=True"),
    ("0.1", "got dropout_p='0.1' \\(str\\)"),
    (None, "got dropout_p=None"),
    (np.asarray([0.1]), "0-d array; got dropout_p of shape \\(1,\\)"),
    (np.asarray(0.1), "from the query's library"),
])
def test_dropout_p_refusals_name_the_value(dropout_p, says):
    torch = require_library("torch", backend="torch")
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="dropout_p must be a float") as info:
        portattn.attention(q, q, q, dropout_p=dropout_p, dropout_seed=1)
    assert info.match(says)


def test_jax_seeds_with_and_without_x64_are_one_seed():
    jax = require_library("jax", backend="jax")
    jnp = jax.numpy
    q, k, _ = (jnp.asarray(a, jnp.float32) for a in _qkv())
    want = np.asarray(dropout.mask(q, k, dropout_p=0.3, dropout_seed=7))
    with jax.enable_x64(False):
        narrow = jnp.asarray(7)
        assert narrow.dtype == jnp.int32
        got = dropout.mask(q, k, dropout_p=0.3, dropout_seed=narrow)
    np.testing.assert_array_equal(np.asarray(got), want)
    with jax.enable_x64(True):
        wide = jnp.asarray(7)
        assert wide.dtype == jnp.int64
        got = dropout.mask(q, k, dropout_p=0.3, dropout_seed=wide)
    np.testing.assert_array_equal(np.asarray(got), want)


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
    for seed, error, says in (
            (True, TypeError, "dropout_seed must be an int"),
            (1.5, TypeError, "dropout_seed must be an int or an integer array; got 1.5"),
            (np.float64(2.0), TypeError, "an int or an integer array; got np.float64"),
            ("7", TypeError, "an int or an integer array; got '7'"),
            (np.zeros(2), TypeError, "integer dtype; got dtype=float64"),
            (np.zeros(5, np.int32), ValueError, "1 to 4 integers of 32 bits"),
            (np.zeros(3, np.int64), ValueError, "got shape \\(3,\\), dtype=int64"),
            (np.zeros(0, np.int32), ValueError, "got shape \\(0,\\)"),
            (2**128, ValueError, f"dropout_seed={2**128}"),
            (-2**127 - 1, ValueError, r"\[-2\*\*127, 2\*\*128\)")):
        with pytest.raises(error, match=says):
            portattn.attention(q, k, v, dropout_p=0.1, dropout_seed=seed)
        with pytest.raises(error, match=says):  # refused the same way without dropout
            portattn.attention(q, k, v, dropout_seed=seed)


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
