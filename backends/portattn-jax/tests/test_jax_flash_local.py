"""``jax_flash`` on a band joined to global tokens, computed in three parts (the band
through the flash loops, the global keys and the global rows dense): forward and lse
against the float64 reference kernel, ``jax.jit(jax.grad)`` with the positions traced
against ``jax.grad`` of the textbook formula in float64; positions that repeat, that
are unused (-1), per batch element; GQA, Lq != Lk, softcap, several blocks."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from jaxcases import Shapes, arrays, jax_backend
from portattn_jax import JaxFlashKernel, _flash_local, register_mask_pytrees

import portattn
from portattn import masks
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")
from textbook import allowed_of, textbook, weighted_loss  # noqa: E402

SHAPES = {
    "mha": Shapes(batch=(1,), hq=2, hkv=2, lq=40, lk=40, d=8, dv=8),
    "gqa_batch": Shapes(batch=(2,), hq=4, hkv=2, lq=37, lk=37, d=8, dv=6),
    "more_keys": Shapes(batch=(2,), hq=3, hkv=1, lq=19, lk=45, d=4, dv=8),
    "more_queries": Shapes(batch=(), hq=2, hkv=1, lq=33, lk=21, d=8, dv=8),
}
BANDS = {
    "window": lambda: masks.sliding_window(4),
    "window_two_sided": lambda: masks.sliding_window(3, 2),
    "causal": lambda: masks.causal(),
    "causal_top_left": lambda: masks.causal("top_left"),
    "causal_and_window": lambda: masks.causal() & masks.sliding_window(5),
}
#: positions of each case, for a batch of 2 where they differ per element
POSITIONS = {
    "spread": np.array([0, 9, 17, 30]),
    "repeated_and_unused": np.array([3, -1, 12, 3, 18, -1, 12]),
    "per_element": np.array([[1, 14, -1, 1], [-1, -1, 20, 7]]),
    "none_used": np.array([-1, -1]),
}
TOLERANCE = {"float64": (1e-9, 1e-10), "float32": (2e-5, 2e-5)}
GRAD_TOL = {"float64": (1e-8, 1e-9), "float32": (2e-4, 2e-4)}


@pytest.fixture(autouse=True)
def _jax():
    jax_backend()
    register_mask_pytrees()


def _case(shape, positions_name):
    s = SHAPES[shape]
    positions = POSITIONS[positions_name]
    if positions.ndim > 1 and s.batch != (2,):
        pytest.skip("per-element positions need a batch of 2")
    return s, positions % s.lk * (positions >= 0) - (positions < 0)


def _mask(band, positions, as_array):
    return BANDS[band]() | masks.global_tokens(as_array(positions))


def test_the_three_parts_are_taken():
    """A band with global tokens goes through the three parts; other masks, a bias, or
    dense parts past ``DENSE_SCORES`` do not."""
    (q, k, v), _ = arrays(SHAPES["mha"], "float64")
    positions = jnp.asarray(POSITIONS["spread"])
    with mock.patch.object(_flash_local, "local_attention",
                           wraps=_flash_local.local_attention) as spy:
        portattn.attention(q, k, v, mask=_mask("window", POSITIONS["spread"], jnp.asarray),
                           kernel="jax_flash")
        assert spy.call_count == 1
        portattn.attention(q, k, v, mask=masks.sliding_window(4), kernel="jax_flash")
        portattn.attention(q, k, v, mask=masks.global_tokens(positions)
                           | masks.documents(jnp.zeros((1, 40), jnp.int32)),
                           kernel="jax_flash")
        portattn.attention(q, k, v, mask=_mask("causal", POSITIONS["spread"], jnp.asarray),
                           bias=jnp.zeros((1, 2, 40, 40)), kernel="jax_flash")
        with mock.patch.object(_flash_local, "DENSE_SCORES", 2 * 4 * 40 - 1):
            portattn.attention(q, k, v, kernel="jax_flash",
                               mask=_mask("window", POSITIONS["spread"], jnp.asarray))
        assert spy.call_count == 1


#: (shape, band, positions, dtype): every combination in float64, a few in float32
FORWARD = [(shape, band, name, "float64") for shape in sorted(SHAPES) for band in sorted(BANDS)
           for name in sorted(POSITIONS)
           if POSITIONS[name].ndim == 1 or SHAPES[shape].batch == (2,)]
FORWARD += [(shape, band, name, "float32") for shape in ("gqa_batch", "more_keys")
            for band in ("window", "causal_and_window")
            for name in ("repeated_and_unused", "per_element")]


@pytest.mark.parametrize(("shape", "band", "positions_name", "dtype"), FORWARD,
                         ids=["-".join(case) for case in FORWARD])
def test_forward_and_lse_match_the_reference(shape, band, positions_name, dtype):
    s, positions = _case(shape, positions_name)
    (q, k, v), (q64, k64, v64) = arrays(s, dtype, seed=3)
    softcap = 2.5 if band == "window_two_sided" else None
    run = jax.jit(lambda q, k, v, p: portattn.attention(
        q, k, v, mask=BANDS[band]() | masks.global_tokens(p), softcap=softcap,
        return_lse=True, kernel="jax_flash"))
    out, lse = run(q, k, v, jnp.asarray(positions))
    want_out, want_lse = portattn.attention(
        q64, k64, v64, mask=_mask(band, positions, np.asarray), softcap=softcap,
        return_lse=True, kernel="reference")
    rtol, atol = TOLERANCE[dtype]
    assert out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=rtol, atol=atol)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(want_lse))
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, rtol=rtol, atol=atol)


#: (shape, band, positions) of the gradient cases
GRAD = [(shape, band, name) for shape, band in (("gqa_batch", "window"),
                                                ("more_keys", "causal_and_window"),
                                                ("more_queries", "causal_top_left"),
                                                ("gqa_batch", "window_two_sided"))
        for name in ("repeated_and_unused", "per_element")
        if POSITIONS[name].ndim == 1 or SHAPES[shape].batch == (2,)]


@pytest.mark.parametrize("blocks_of", [None, 8])
@pytest.mark.parametrize(("shape", "band", "positions_name"), GRAD,
                         ids=["-".join(case) for case in GRAD])
def test_jit_grad_matches_the_float64_textbook(shape, band, positions_name, blocks_of):
    s, positions = _case(shape, positions_name)
    (q, k, v), np_args = arrays(s, "float64", seed=7)
    rng = np.random.default_rng(8)
    w_out = rng.standard_normal((*s.batch, s.hq, s.lq, s.dv))
    w_lse = rng.standard_normal((*s.batch, s.hq, s.lq))
    allowed = allowed_of(_mask(band, positions, np.asarray), s.batch, s.hq, s.lq, s.lk)
    softcap = 2.0 if band == "window_two_sided" else None

    def loss(q, k, v, p):
        out, lse = portattn.attention(q, k, v, mask=BANDS[band]() | masks.global_tokens(p),
                                      softcap=softcap, return_lse=True, kernel="jax_flash")
        return weighted_loss(out, lse, w_out, w_lse)

    def reference(q, k, v):
        return weighted_loss(*textbook(q, k, v, allowed=allowed, softcap=softcap),
                             w_out, w_lse)

    with mock.patch.object(JaxFlashKernel, "max_block",
                           blocks_of or JaxFlashKernel.max_block):
        got = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v, jnp.asarray(positions))
    want = jax.grad(reference, (0, 1, 2))(*(jnp.asarray(a) for a in np_args))
    rtol, atol = GRAD_TOL["float64"]
    for what, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert np.isfinite(np.asarray(g)).all(), what
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol,
                                   err_msg=what)


def test_float32_grad_against_the_block_form():
    """The three parts and the union's block form give the same float32 gradients."""
    s = SHAPES["gqa_batch"]
    (q, k, v), _ = arrays(s, "float32", seed=9)
    mask = masks.sliding_window(4) | masks.global_tokens(jnp.asarray([5, 30, -1]))

    def loss(q, k, v):
        return jnp.sum(portattn.attention(q, k, v, mask=mask, kernel="jax_flash") ** 2)

    got = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    with mock.patch.object(_flash_local, "band_and_tokens", return_value=None):
        want = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    rtol, atol = GRAD_TOL["float32"]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def test_a_hidden_non_finite_key_reaches_no_other_row():
    """Key 0 holds NaN and inf; unused positions (-1) must not bring it to rows that do
    not see it, in the output or in their query gradients."""
    s = SHAPES["mha"]
    (q, k, v), (q64, k64, v64) = arrays(s, "float64", seed=11)
    k, v = k.at[..., 0, :].set(jnp.nan), v.at[..., 0, :].set(jnp.inf)
    k64, v64 = np.array(k64), np.array(v64)
    k64[..., 0, :], v64[..., 0, :] = np.nan, np.inf
    positions = np.array([-1, 20, -1])
    sees = np.zeros(s.lq, bool)
    sees[:5] = sees[20] = True  # the window's first rows and the global row
    out = jax.jit(lambda q, k, v, p: portattn.attention(
        q, k, v, mask=masks.sliding_window(4) | masks.global_tokens(p),
        kernel="jax_flash"))(q, k, v, jnp.asarray(positions))
    want = portattn.attention(q64, k64, v64, mask=_mask("window", positions, np.asarray),
                              kernel="reference")
    out = np.asarray(out)
    assert np.isnan(out[..., sees, :]).all()
    np.testing.assert_allclose(out[..., ~sees, :], want[..., ~sees, :], rtol=1e-9,
                               atol=1e-10)

    def loss(q):
        got = portattn.attention(q, k, v, kernel="jax_flash",
                                 mask=masks.sliding_window(4) | masks.global_tokens(
                                     jnp.asarray(positions)))
        return jnp.sum(jnp.where(jnp.asarray(sees)[:, None], 0, got) ** 2)

    dq = np.asarray(jax.jit(jax.grad(loss))(q))
    assert np.isfinite(dq[..., ~sees, :]).all()
