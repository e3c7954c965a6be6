"""Score changes that map each score (portattn.scores.function, scores.softcap), against
a float64 textbook written with whole score matrices.

The textbook computes the scores, maps them, masks, takes the softmax, and for the
gradients runs the chain rule by hand (NumPy) or the library's autograd on the whole
matrix (torch, JAX): none of it shares code with the kernels' tile-wise path.
"""

from __future__ import annotations

import numpy as np
import pytest
from array_api_compat import array_namespace

import portattn
from portattn import masks, scores
from portattn.autograd import flash_backward, flash_forward
from portattn.kernel import describe
from portattn.testing import assert_close, to_numpy
from portattn.testing.plugin import require_backend

B, H, HKV, LQ, LK, D = 2, 4, 2, 19, 27, 8


def arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"q": rng.standard_normal((B, H, LQ, D)) * 2,
            "k": rng.standard_normal((B, HKV, LK, D)),
            "v": rng.standard_normal((B, HKV, LK, D)),
            "weight": rng.uniform(0.5, 1.5, (H, 1, 1)),
            "cap": rng.uniform(1.0, 3.0, H),
            "table": rng.standard_normal((H, LQ + LK - 1)),
            "segments": np.sort(rng.integers(0, 3, (B, LK)), axis=-1)}


def weighted(score, b, h, q_idx, kv_idx, weight):
    """Written against the array API (every library, Dask's chunks too): the integer
    indices are cast before they meet floats (array-api-strict promotes none)."""
    xp = array_namespace(score)
    return score * weight + xp.astype((q_idx - kv_idx) * (b + 1), score.dtype) * (weight * 0.01)


def textbook_scores(a: dict[str, np.ndarray]) -> np.ndarray:
    k = np.repeat(a["k"], H // HKV, axis=1)
    return a["q"] @ np.swapaxes(k, -1, -2) / np.sqrt(D)


def textbook(a: dict[str, np.ndarray], mapped: np.ndarray, allowed: np.ndarray):
    """``(out, lse, weights)`` of scores already mapped."""
    s = np.where(allowed, mapped, -np.inf)
    lse = np.logaddexp.reduce(s, axis=-1)
    p = np.exp(s - lse[..., None])
    return p @ np.repeat(a["v"], H // HKV, axis=1), lse, p


def causal_pairs() -> np.ndarray:
    i, j = np.arange(LQ)[:, None], np.arange(LK)[None, :]
    return j <= i + LK - LQ


def documents_pairs(segments: np.ndarray) -> np.ndarray:
    return (segments[:, None, LK - LQ:, None] == segments[:, None, None, :]) & causal_pairs()


def f64(backend, a):
    return backend.asarray(a, "float64")


@pytest.mark.parametrize("mask", ["none", "causal", "documents"])
def test_a_function_maps_the_scores_on_every_backend(mask, backend):
    if "float64" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float64")
    a = arrays()
    change = scores.function(weighted, (f64(backend, a["weight"]),))
    segments = backend.asarray(a["segments"])
    call_mask = {"none": None, "causal": masks.causal(),
                 "documents": masks.documents(segments[..., LK - LQ:], segments)
                 & masks.causal()}[mask]
    allowed = {"none": np.ones((LQ, LK), bool), "causal": causal_pairs(),
               "documents": documents_pairs(a["segments"])}[mask]
    b = np.arange(B)[:, None, None, None]
    i, j = np.arange(LQ)[:, None], np.arange(LK)[None, :]
    mapped = textbook_scores(a) * a["weight"] + (i - j) * (b + 1) * (a["weight"] * 0.01)
    want, want_lse, _ = textbook(a, mapped, allowed)
    q, k, v = (f64(backend, a[n]) for n in "qkv")
    for kernel in ("tiled", "reference"):
        out, lse = portattn.attention(q, k, v, mask=call_mask, score_mod=change,
                                      return_lse=True, kernel=kernel)
        assert_close(out, want, "float64")
        assert_close(lse, want_lse, "float64", "lse")


def test_a_learned_softcap_and_its_cap_gradient_match_the_textbook(backend):
    if "float64" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float64")
    a = arrays(1)
    cap = a["cap"][:, None, None]
    x = textbook_scores(a) / cap
    t = np.tanh(x)
    want, want_lse, p = textbook(a, cap * t, causal_pairs())
    q, k, v = (f64(backend, a[n]) for n in "qkv")
    inputs = describe(q, k, v, mask=masks.causal(), score_mod=scores.softcap(
        f64(backend, a["cap"])), return_lse=True)
    out, lse = flash_forward(inputs)
    assert_close(out, want, "float64")
    assert_close(lse, want_lse, "float64", "lse")
    rng = np.random.default_rng(2)
    dout = rng.standard_normal(want.shape)
    ds = p * (dout @ np.swapaxes(np.repeat(a["v"], H // HKV, axis=1), -1, -2)
              - (dout * want).sum(-1, keepdims=True))
    dcap = (ds * (t - x * (1 - t * t))).sum(axis=(0, 2, 3))
    dq = (ds * (1 - t * t)) @ np.repeat(a["k"], H // HKV, axis=1) / np.sqrt(D)
    grads = flash_backward(inputs, out, lse, f64(backend, dout))
    np.testing.assert_allclose(to_numpy(grads.score_mod[0]), dcap, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(to_numpy(grads.query), dq, rtol=1e-10, atol=1e-10)
    # a scalar cap is the softcap= argument, where no bias comes between
    scalar = portattn.attention(q, k, v, score_mod=scores.softcap(f64(backend, np.asarray(2.5))))
    assert_close(scalar, portattn.attention(q, k, v, softcap=2.5), "float64")


def gathered(score, b, h, q_idx, kv_idx, table, cap):
    """A per-head cap and a bias gathered by distance: T5-like, written by hand."""
    capped = cap[h] * _tanh(score / cap[h])
    return capped + table[h, kv_idx - q_idx + LQ - 1]


def _tanh(x):
    return x.tanh() if hasattr(x, "tanh") else __import__("jax").numpy.tanh(x)


def dense_loss(xp, q, k, v, table, cap, dout, allowed):
    """The loss with whole score matrices, for the library's autograd."""
    k, v = (xp.repeat(t, H // HKV, axis=1) for t in (k, v))
    s = q @ xp.swapaxes(k, -1, -2) / np.sqrt(D)
    c = cap[:, None, None]
    i, j = np.arange(LQ)[:, None], np.arange(LK)[None, :]
    s = c * _tanh(s / c) + table[:, j - i + LQ - 1]
    s = xp.where(xp.asarray(allowed), s, -np.inf)
    p = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
    out = (p / xp.sum(p, axis=-1, keepdims=True)) @ v
    return xp.sum(out * dout)


def test_torch_autograd_differentiates_a_function_through_its_arrays_bitwise():
    torch = require_backend("torch").xp
    a = arrays(3)
    dout = torch.asarray(np.random.default_rng(4).standard_normal((B, H, LQ, D)))
    runs = []
    for _ in range(2):
        leaves = [torch.asarray(a[n], requires_grad=True) for n in ("q", "k", "v", "table",
                                                                    "cap")]
        q, k, v, table, cap = leaves
        change = scores.function(gathered, (table, cap))
        out = portattn.attention(q, k, v, mask=masks.causal(), score_mod=change)
        (out * dout).sum().backward()
        runs.append([t.grad.numpy().copy() for t in leaves])
    plain = [torch.asarray(a[n], requires_grad=True) for n in ("q", "k", "v", "table", "cap")]
    dense_loss(torch, *plain, dout, causal_pairs()).backward()
    for got, want in zip(runs[0], plain, strict=True):
        np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-10, atol=1e-10)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(*runs, strict=True))


def test_jax_jit_grad_differentiates_a_function_through_its_arrays():
    jax_backend = require_backend("jax")
    import jax

    jnp = jax_backend.xp
    a = arrays(5)
    dout = jnp.asarray(np.random.default_rng(6).standard_normal((B, H, LQ, D)))
    names = ("q", "k", "v", "table", "cap")

    def loss(q, k, v, table, cap):
        out = portattn.attention(q, k, v, mask=masks.causal(),
                                 score_mod=scores.function(gathered, (table, cap)))
        return jnp.sum(out * dout)

    values = [jnp.asarray(a[n]) for n in names]
    got = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(*values)
    want = jax.grad(lambda *x: dense_loss(jnp, *x, dout, causal_pairs()),
                    argnums=tuple(range(5)))(*values)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-10, atol=1e-10)


def test_a_function_needs_autodiff_for_its_gradients():
    a = arrays()
    inputs = describe(a["q"], a["k"], a["v"], score_mod=scores.function(
        weighted, (a["weight"],)), return_lse=True)
    out, lse = flash_forward(inputs)
    with pytest.raises(TypeError, match="needs autodiff, which numpy arrays lack"):
        flash_backward(inputs, out, lse, np.ones_like(out))


def test_fast_kernels_leave_functions_to_the_portable_ones():
    q = np.zeros((1, 2, 8, 4))
    change = scores.softcap(np.asarray(3.0))
    plan = portattn.explain(q, q, q, score_mod=change)
    assert plan.kernel.name == "tiled"
    assert any("softcap(cap()) (a score function) not supported" in str(why)
               for _, why in plan.candidates), str(plan)


def _bool_scores(score, b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize(("make", "error", "says"), [
    (lambda: scores.function("not callable"), TypeError, "expects a callable fn(score"),
    (lambda: scores.function(weighted, np.ones(3)), TypeError,
     "args must be a tuple of arrays"),
    (lambda: scores.function(weighted, (3.0,)), TypeError, "args[0] must be an array"),
    (lambda: scores.function(_bool_scores), TypeError,
     "must return floating scores; got dtype=bool"),
    (lambda: scores.function(lambda s, b, h, q, k: s[..., :1, :1, None]), ValueError,
     "must return scores that broadcast to the tile's (1, 2, 1, 1)"),
    (lambda: scores.softcap(np.ones(3)), ValueError,
     "cap must have shape () or (Hq,) = (2,); got cap.shape=(3,)"),
    (lambda: scores.softcap(np.asarray([1.0, -1.0])), ValueError,
     "cap must be positive; got cap=[1.0, -1.0]"),
    (lambda: scores.softcap(np.asarray(1.0)) + scores.alibi(np.ones(2)), TypeError,
     "maps each score, it adds no entries"),
])
def test_bad_functions_are_refused_by_name(make, error, says):
    q = np.zeros((1, 2, 8, 4))
    with pytest.raises(error) as raised:
        portattn.attention(q, q, q, score_mod=make())
    assert says in str(raised.value)


def test_a_mapping_has_no_entries_to_show():
    with pytest.raises(TypeError, match="maps each score"):
        scores.softcap(np.asarray(1.0)).dense(4, 4)
