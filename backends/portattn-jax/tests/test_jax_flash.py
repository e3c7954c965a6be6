"""``jax_flash``: forward against the float64 oracle, gradients against ``jax.grad`` of
the textbook formula in float64, over random shapes, masks, GQA, softcap, bias and
dtypes; small blocks so every case spans several tiles."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jaxcases import jax_backend
from portattn_jax import JaxFlashKernel, register_mask_pytrees

import portattn
from portattn import masks
from portattn.testing import assert_close, check_case, conformance_cases, oracle
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")
from textbook import allowed_of, textbook, weighted_loss  # noqa: E402

#: Gradient tolerances (rtol, atol) relative to gradients of magnitude ~1.
GRAD_TOL = {"float64": (1e-8, 1e-9), "float32": (2e-4, 2e-4), "float16": (2e-2, 2e-2),
            "bfloat16": (1e-1, 1e-1)}


@pytest.fixture(autouse=True)
def _jax():
    jax_backend()
    register_mask_pytrees()


@pytest.mark.parametrize("case", conformance_cases(JaxFlashKernel), ids=str)
def test_conformance(case):
    check_case(JaxFlashKernel, case, jax_backend())


@st.composite
def calls(draw):
    """(shapes, dtype, mask parts, bias kind, softcap, scale, block) of one call."""
    dtype = draw(st.sampled_from(["float64", "float64", "float32", "float16", "bfloat16"]))
    batch = draw(st.sampled_from([(), (2,), (2, 1)]))
    hkv = draw(st.sampled_from([1, 2]))
    hq = hkv * draw(st.sampled_from([1, 2, 3]))
    lq, lk = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    d, dv = draw(st.sampled_from([4, 8])), draw(st.sampled_from([3, 4, 8]))
    kinds = draw(st.lists(st.sampled_from(["causal_br", "causal_tl", "window", "key_lengths",
                                           "query_lengths", "dense"]), max_size=3, unique=True))
    parts = []
    for kind in kinds:
        if kind == "window":
            parts.append(("window", draw(st.integers(0, 6)), draw(st.integers(0, 3))))
        elif kind in ("key_lengths", "query_lengths"):
            top = lk if kind == "key_lengths" else lq
            parts.append((kind, draw(st.lists(st.integers(0, top), min_size=2, max_size=2))))
        else:
            parts.append((kind,))
    bias = draw(st.sampled_from([None, "heads", "keys", "full"]))
    softcap = draw(st.sampled_from([None, None, 1.5]))
    scale = draw(st.sampled_from([None, 0.4]))
    block = draw(st.sampled_from([4, 8]))
    return (batch, hq, hkv, lq, lk, d, dv), dtype, parts, bias, softcap, scale, block


def _build_mask(parts, batch, hq, lq, lk, convert):
    """The drawn mask parts combined with ``&``, arrays made by ``convert``."""
    rng = np.random.default_rng(1)  # the same draws for JAX and NumPy
    mask = None
    for kind, *args in parts:
        if kind.startswith("causal"):
            m = masks.causal("bottom_right" if kind == "causal_br" else "top_left")
        elif kind == "window":
            m = masks.sliding_window(*args)
        elif kind in ("key_lengths", "query_lengths"):
            lengths = np.resize(np.asarray(args[0]), int(np.prod(batch))).reshape(batch)
            m = getattr(masks, kind)(convert(lengths))
        else:  # per head (grouped-query heads too) or broadcast over heads
            heads = hq if (lq + lk) % 2 else 1
            m = masks.dense(convert(rng.random((*batch, heads, lq, lk)) < 0.6))
        mask = m if mask is None else mask & m
    return mask


def _bias(kind, batch, hq, lq, lk, rng):
    if kind is None:
        return None
    shape = {"heads": (hq, lq, lk), "keys": (*batch, 1, 1, lk), "full": (*batch, hq, lq, lk)}
    b = rng.standard_normal(shape[kind])
    if kind == "full":
        b[..., 0, :] = -np.inf  # a row without keys when the mask also hides the rest
        b[..., 0, 0] = 0.0
    return b


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_matches_oracle_and_textbook_gradients(call):
    shapes, dtype, parts, bias_kind, softcap, scale, block = call
    batch, hq, hkv, lq, lk, d, dv = shapes
    backend = jax_backend()
    rng = np.random.default_rng(0)
    dims = ((*batch, hq, lq, d), (*batch, hkv, lk, d), (*batch, hkv, lk, dv))
    q, k, v = (backend.asarray(rng.standard_normal(s), dtype) for s in dims)
    q64, k64, v64 = (np.asarray(backend.to_numpy(a), np.float64) for a in (q, k, v))
    bias64 = _bias(bias_kind, batch, hq, lq, lk, rng)
    bias = None if bias64 is None else backend.asarray(bias64, dtype)
    bias64 = None if bias is None else np.asarray(backend.to_numpy(bias), np.float64)
    mask = _build_mask(parts, batch, hq, lq, lk, backend.asarray) if parts else None
    np_mask = _build_mask(parts, batch, hq, lq, lk, np.asarray) if parts else None
    w_out = rng.standard_normal((*batch, hq, lq, dv))
    w_lse = rng.standard_normal((*batch, hq, lq))

    def loss(q, k, v, bias, mask):
        out, lse = portattn.attention(q, k, v, mask=mask, bias=bias, softcap=softcap,
                                      scale=scale, return_lse=True, kernel="jax_flash")
        return weighted_loss(out.astype(lse.dtype), lse, w_out, w_lse), (out, lse)

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    with mock.patch.object(JaxFlashKernel, "max_block", block):
        grads, (out, lse) = jax.jit(jax.grad(loss, argnums, has_aux=True))(q, k, v, bias, mask)
    want_out, want_lse, _ = oracle(q64, k64, v64, mask=np_mask, bias=bias64, softcap=softcap,
                                   scale=scale)
    assert out.dtype == q.dtype
    assert_close(out, want_out, dtype, "out")
    assert_close(lse, want_lse, dtype, "lse")

    allowed = allowed_of(np_mask, batch, hq, lq, lk)

    def reference(q, k, v, bias):
        out, lse = textbook(q, k, v, allowed=allowed, bias=bias, scale=scale, softcap=softcap)
        return weighted_loss(out, lse, w_out, w_lse)

    b64 = None if bias64 is None else jnp.asarray(bias64)
    want = jax.jit(jax.grad(reference, argnums))(*(jnp.asarray(a) for a in (q64, k64, v64)), b64)
    rtol, atol = GRAD_TOL[dtype]
    for name, got, expected in zip(("dq", "dk", "dv", "dbias"), grads, want, strict=False):
        assert got.dtype == q.dtype, f"{name} dtype {got.dtype}"
        got = np.asarray(got.astype(jnp.float64))
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, np.asarray(expected), rtol=rtol, atol=atol,
                                   err_msg=f"{name} ({dtype})")
