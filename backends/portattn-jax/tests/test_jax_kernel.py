"""``jax_dpa`` where JAX and portattn disagree, and how dispatch treats it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from jaxcases import Shapes, arrays, jax_backend, mask_pair
from portattn_jax import JaxDpaKernel

import portattn
from portattn import masks
from portattn.testing import assert_close, oracle
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")

SHAPES = Shapes(batch=(2,), hq=4, hkv=2, lq=6, lk=5, d=8, dv=8)


@pytest.fixture(autouse=True)
def _jax():
    jax_backend()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mask_name", ["none", "causal", "key_lengths", "dense"])
def test_dispatch_picks_jax_dpa(dtype, mask_name):
    (q, k, v), _ = arrays(SHAPES, dtype)
    mask, _ = mask_pair(mask_name, SHAPES)
    assert portattn.explain(q, k, v, mask=mask).kernel.name == "jax_dpa"


UNSUPPORTED = {
    "float64": ({}, "float64", "dtype=float64"),
    "softcap": ({"softcap": 2.0}, "float32", "softcap not supported"),
    "return_lse": ({"return_lse": True}, "float32", "return_lse not supported"),
    "return_weights": ({"return_weights": True}, "float32", "return_weights not supported"),
}


@pytest.mark.parametrize("what", sorted(UNSUPPORTED))
def test_unsupported_falls_back(what):
    kwargs, dtype, reason = UNSUPPORTED[what]
    (q, k, v), np_args = arrays(SHAPES, dtype)
    plan = portattn.explain(q, k, v, mask=masks.causal(), **kwargs)
    assert plan.kernel is not None
    assert plan.kernel.name != "jax_dpa"
    why = dict((e.name, w) for e, w in plan.candidates)["jax_dpa"]
    assert any(reason in w for w in why), why
    with pytest.raises(ValueError, match=reason):
        portattn.attention(q, k, v, mask=masks.causal(), kernel="jax_dpa", **kwargs)
    got = portattn.attention(q, k, v, mask=masks.causal(), **kwargs)
    out, lse, weights = oracle(*np_args, mask=masks.causal(), **kwargs)
    want = [out] + [lse] * bool(kwargs.get("return_lse")) + [weights] * bool(
        kwargs.get("return_weights"))
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for part, expected, what in zip(got, want, ("out", "extra"), strict=False):
        assert_close(part, expected, dtype, what)


def test_large_score_matrix_falls_back(monkeypatch):
    (q, k, v), np_args = arrays(SHAPES, "float32")
    monkeypatch.setattr(JaxDpaKernel, "xla_score_limit", 2 * 4 * 6 * 5 - 1)
    monkeypatch.setattr(JaxDpaKernel, "xla_score_limit_cpu", 2 * 4 * 6 * 5 - 1)
    plan = portattn.explain(q, k, v)
    assert plan.kernel.name != "jax_dpa"
    why = dict((e.name, w) for e, w in plan.candidates)["jax_dpa"]
    assert any("score matrix of 240 elements" in w for w in why), why
    assert all(w.startswith("passed over: ") for w in why), why  # a preference
    assert_close(portattn.attention(q, k, v), oracle(*np_args)[0], "float32")
    # named, it runs: the XLA path computes the call exactly, whatever its size
    assert portattn.explain(q, k, v, kernel="jax_dpa").kernel.name == "jax_dpa"
    assert_close(portattn.attention(q, k, v, kernel="jax_dpa"), oracle(*np_args)[0], "float32")


def _rows_without_keys(name, xp_convert, s):
    """(mask, bias) leaving some query rows no key, built with ``xp_convert``."""
    neg_inf_row = np.zeros((*s.batch, s.hq, s.lq, s.lk))
    neg_inf_row[0, 1, 2, :] = -np.inf
    neg_inf_row[1, :, 0, :2] = -np.inf  # partly -inf: still has keys
    if name == "bias_row_of_minus_inf":
        return None, xp_convert(neg_inf_row)
    if name == "bias_minus_inf_where_allowed":
        # Row 3 keeps keys 0 and 1 only, and the bias is -inf exactly there.
        allowed = np.ones((*s.batch, s.hq, s.lq, s.lk), dtype=bool)
        allowed[:, :, 3, 2:] = False
        bias = np.zeros_like(neg_inf_row)
        bias[:, :, 3, :2] = -np.inf
        return masks.dense(xp_convert(allowed)), xp_convert(bias)
    if name == "dense_row_all_false":
        allowed = np.random.default_rng(5).random((*s.batch, s.hq, s.lq, s.lk)) < 0.5
        allowed[1, 2, 4, :] = False
        return masks.dense(xp_convert(allowed)), None
    if name == "key_length_zero":
        return masks.key_lengths(xp_convert(np.array([0, 3]))), None
    if name == "causal_long_queries":  # bottom-right, Lq > Lk: the first rows see nothing
        return masks.causal(), None
    if name == "query_lengths":
        return masks.query_lengths(xp_convert(np.array([2, 6]))), None
    if name == "window_and_key_lengths":  # the window lies past the valid keys
        return masks.sliding_window(1, 0) & masks.key_lengths(xp_convert(np.array([2, 5]))), None
    msg = f"unknown case {name!r}"
    raise ValueError(msg)


ROWS_WITHOUT_KEYS = ["bias_row_of_minus_inf", "bias_minus_inf_where_allowed",
                     "dense_row_all_false", "key_length_zero", "causal_long_queries",
                     "query_lengths", "window_and_key_lengths"]


@pytest.mark.parametrize("name", ROWS_WITHOUT_KEYS)
def test_rows_without_keys_are_zero(name):
    backend = jax_backend()
    (q, k, v), np_args = arrays(SHAPES, "float32")
    mask, bias = _rows_without_keys(name, lambda a: backend.asarray(a, None), SHAPES)
    np_mask, np_bias = _rows_without_keys(name, np.asarray, SHAPES)
    if bias is not None:
        bias = bias.astype(jnp.float32)
    want, want_lse, _ = oracle(*np_args, mask=np_mask, bias=np_bias)
    empty = np.isneginf(want_lse)
    assert empty.any(), "the case must leave some row without keys"

    def loss(q, k, v):
        out = portattn.attention(q, k, v, mask=mask, bias=bias, kernel="jax_dpa")
        return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape) / out.size)

    out = portattn.attention(q, k, v, mask=mask, bias=bias, kernel="jax_dpa")
    assert_close(out, want, "float32")
    assert not np.asarray(out)[empty].any()
    dq, dk, dv = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    for g in (dq, dk, dv):
        assert np.isfinite(np.asarray(g)).all()
    assert not np.asarray(dq)[empty].any(), "rows without keys must not pass gradients"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_under_jit(dtype):
    (q, k, v), np_args = arrays(SHAPES, dtype)
    mask, np_mask = mask_pair("causal_and_key_lengths", SHAPES)
    attend = jax.jit(lambda q, k, v: portattn.attention(q, k, v, mask=mask, kernel="jax_dpa"))
    out = attend(q, k, v)
    assert out.dtype == q.dtype
    assert_close(out, oracle(*np_args, mask=np_mask)[0], dtype)


def test_batch_dims_with_partial_broadcasts():
    backend = jax_backend()
    s = Shapes(batch=(2, 3), hq=2, hkv=1, lq=4, lk=6, d=8, dv=8)
    (q, k, v), np_args = arrays(s, "float32")
    rng = np.random.default_rng(7)
    bias = rng.standard_normal((3, 1, s.lq, s.lk))  # broadcast over the first batch dim
    allowed = rng.random((2, 1, 1, 1, s.lk)) < 0.7  # over the second, heads and queries
    lengths = np.array([[6, 5, 4], [3, 2, 1]])
    mask = masks.dense(backend.asarray(allowed)) & masks.key_lengths(backend.asarray(lengths))
    np_mask = masks.dense(allowed) & masks.key_lengths(lengths)
    got = portattn.attention(q, k, v, mask=mask, bias=backend.asarray(bias, "float32"),
                             kernel="jax_dpa")
    want = oracle(*np_args, mask=np_mask, bias=np.asarray(bias, np.float32))[0]
    assert_close(got, want, "float32")


def test_grouped_query_with_per_head_mask_and_bias():
    # Query head h belongs to key/value head h // (Hq / Hkv), in portattn as in JAX.
    backend = jax_backend()
    s = Shapes(batch=(2,), hq=6, hkv=2, lq=5, lk=7)
    (q, k, v), np_args = arrays(s, "float32")
    rng = np.random.default_rng(8)
    allowed = rng.random((2, 6, 5, 7)) < 0.6
    bias = rng.standard_normal((6, 5, 7)).astype(np.float32)
    got = portattn.attention(q, k, v, mask=backend.asarray(allowed),
                             bias=backend.asarray(bias), kernel="jax_dpa")
    assert_close(got, oracle(*np_args, mask=allowed, bias=bias)[0], "float32")


@pytest.mark.parametrize(("d", "dv"), [(24, 16), (8, 40)])
def test_value_head_dim_differs(d, dv):
    s = Shapes(d=d, dv=dv)
    (q, k, v), np_args = arrays(s, "float32")
    got = portattn.attention(q, k, v, mask=masks.causal(), kernel="jax_dpa")
    assert got.shape == (*s.batch, s.hq, s.lq, dv)
    assert_close(got, oracle(*np_args, mask=masks.causal())[0], "float32")


def test_empty_sequences_give_zeros():
    for lq, lk in ((0, 5), (4, 0)):
        s = Shapes(lq=lq, lk=lk)
        (q, k, v), _ = arrays(s, "float32")
        out = portattn.attention(q, k, v, kernel="jax_dpa")
        assert out.shape == (*s.batch, s.hq, lq, s.dv)
        assert not np.asarray(out).any()


def test_numpy_inputs_do_not_import_jax():
    # Dispatch asks every kernel about every call; for NumPy arrays this one must answer
    # without importing JAX (1 s or more).
    code = ("import sys, numpy as np\n"
            "from portattn.kernel import describe\n"
            "from portattn_jax import JaxDpaKernel\n"
            "x = np.ones((1, 2, 3, 4))\n"
            "assert JaxDpaKernel.available() is None\n"
            "print(JaxDpaKernel.not_supported_reasons(describe(x, x, x)))\n"
            "print('jax' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    reasons, imported = result.stdout.strip().splitlines()
    assert "namespace=numpy" in reasons
    assert imported == "False", result.stdout + result.stderr


def test_importing_after_jax_makes_masks_pytrees():
    code = ("import jax, numpy as np\n"
            "import portattn_jax\n"
            "from portattn import masks\n"
            "m = masks.causal() & masks.key_lengths(np.array([3, 4]))\n"
            "leaves, tree = jax.tree_util.tree_flatten(m)\n"
            "print(len(leaves), tree.unflatten(leaves))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "1 causal(bottom_right) & key_lengths(shape=(2,))", (
        result.stdout + result.stderr)
