"""Folding portattn masks into JAX's band, lengths and dense arguments, checked against
the masks' own boolean tiles; and where cuDNN is chosen."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from portattn_jax._kernel import choose_implementation
from portattn_jax._translate import Band, fold_mask

import portattn
from portattn import masks

positional = st.one_of(
    st.sampled_from([masks.causal("bottom_right"), masks.causal("top_left")]),
    st.builds(masks.sliding_window, st.one_of(st.none(), st.integers(0, 6)),
              st.one_of(st.none(), st.integers(0, 6))),
)


def _inputs(lq: int, lk: int, mask, batch=(), hq=1, hkv=1, d=8, dv=8, dtype="float32",
            bias=None):
    q = np.zeros((*batch, hq, lq, d), dtype=dtype)
    k = np.zeros((*batch, hkv, lk, d), dtype=dtype)
    v = np.zeros((*batch, hkv, lk, dv), dtype=dtype)
    return portattn.explain(q, k, v, mask=mask, bias=bias).inputs


def _tile(mask, lq: int, lk: int) -> np.ndarray:
    """The mask's boolean tile over the whole problem (None from it means all True)."""
    tile = mask.tile(np, 0, lq, 0, lk, lq, lk)
    return np.ones((lq, lk), dtype=bool) if tile is None else tile


def _band_matrix(band: Band | None, lq: int, lk: int) -> np.ndarray:
    if band is None:
        return np.ones((lq, lk), dtype=bool)
    left, right = band.window(lq, lk)  # what JAX receives as local_window_size
    i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
    return (i <= j + left) & (i >= j - right)  # JAX's own formula


@settings(max_examples=300, deadline=None)
@given(st.lists(positional, min_size=1, max_size=3), st.integers(1, 12), st.integers(1, 12))
def test_band_equals_the_mask(parts, lq, lk):
    mask = parts[0]
    for p in parts[1:]:
        mask = mask & p
    spec = fold_mask(_inputs(lq, lk, mask))
    want = np.broadcast_to(_tile(mask, lq, lk), (lq, lk))
    np.testing.assert_array_equal(_band_matrix(spec.band, lq, lk), want)
    start, stop = (spec.band or Band(None, None)).rows_with_keys(lq, lk)
    rows = np.zeros(lq, dtype=bool)
    rows[start:stop] = True
    np.testing.assert_array_equal(rows, want.any(axis=1))


@settings(max_examples=150, deadline=None)
@given(positional, st.integers(2, 12), st.integers(2, 12), st.data())
def test_band_of_a_restricted_mask(part, lq, lk, data):
    # Blockwise schedulers hand kernels sub-problems whose masks carry a shift.
    if not hasattr(part, "restrict"):
        pytest.skip("masks cannot be restricted in this portattn")
    q0 = data.draw(st.integers(0, lq - 1))
    q1 = data.draw(st.integers(q0 + 1, lq))
    k0 = data.draw(st.integers(0, lk - 1))
    k1 = data.draw(st.integers(k0 + 1, lk))
    sub = part.restrict(np, q0, q1, k0, k1, lq, lk)
    spec = fold_mask(_inputs(q1 - q0, k1 - k0, sub))
    whole = np.broadcast_to(_tile(part, lq, lk), (lq, lk))
    np.testing.assert_array_equal(_band_matrix(spec.band, q1 - q0, k1 - k0),
                                  whole[q0:q1, k0:k1])


@settings(max_examples=100, deadline=None)
@given(positional, st.integers(1, 9), st.integers(1, 9), st.data())
def test_rows_with_keys_under_lengths(part, lq, lk, data):
    jnp = pytest.importorskip("jax.numpy")
    from portattn_jax._compute import _rows_from_band

    key_lengths = np.array(data.draw(st.lists(st.integers(0, lk), min_size=3, max_size=3)))
    query_lengths = np.array(data.draw(st.lists(st.integers(0, lq), min_size=3, max_size=3)))
    mask = part & masks.key_lengths(key_lengths) & masks.query_lengths(query_lengths)
    spec = fold_mask(_inputs(lq, lk, mask, batch=(3,)))
    got = _rows_from_band(spec.band, lq, lk, jnp.asarray(key_lengths),
                          jnp.asarray(query_lengths))
    want = _tile(mask, lq, lk).any(axis=-1)  # (3, 1, lq)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_lengths_and_dense_pass_through():
    lengths = np.array([3, 1])
    allowed = np.ones((2, 1, 4, 5), dtype=bool)
    mask = masks.key_lengths(lengths) & masks.dense(allowed) & masks.key_lengths(lengths - 1)
    spec = fold_mask(_inputs(4, 5, mask, batch=(2,)))
    assert spec.band is None
    assert len(spec.key_lengths) == 2
    assert [p.kind for p in spec.computed] == ["dense"]
    assert not spec.query_lengths


CUDNN = [
    ("half, no mask", {}, None, "cudnn"),
    ("half, causal top-left", {}, masks.causal("top_left"), "cudnn"),
    ("half, causal square", {}, masks.causal(), "cudnn"),
    ("half, causal left window", {}, masks.sliding_window(3, 0), "cudnn"),
    ("half, causal with key lengths", {"batch": (2,)},
     "causal_key_lengths", "cudnn"),
    ("float32", {"dtype": "float32"}, masks.causal(), "xla"),
    ("bottom-right cross", {"lq": 4}, masks.causal(), "xla"),
    ("right window", {}, masks.sliding_window(2, 2), "xla"),
    ("rows without keys", {"lq": 9, "lk": 3}, masks.causal("top_left")
     & masks.sliding_window(1, 0), "xla"),
    ("window with key lengths", {"batch": (2,)}, "window_key_lengths", "xla"),
    ("head dim 12", {"d": 12, "dv": 12}, None, "xla"),
    ("head dim 320", {"d": 320, "dv": 320}, None, "xla"),
    ("dense", {}, "dense", "xla"),
    ("bias", {"bias": True}, None, "xla"),
]


@pytest.mark.parametrize(("kwargs", "mask", "want"), [c[1:] for c in CUDNN],
                         ids=[c[0] for c in CUDNN])
def test_cudnn_only_where_exact(kwargs, mask, want):
    kwargs = {"lq": 8, "lk": 8, "dtype": "float16", **kwargs}
    lengths = np.array([5, 0])
    if mask == "causal_key_lengths":
        mask = masks.causal() & masks.key_lengths(lengths)
    elif mask == "window_key_lengths":
        mask = masks.sliding_window(2, 0) & masks.key_lengths(lengths)
    elif mask == "dense":
        mask = masks.dense(np.ones((8, 8), dtype=bool))
    if kwargs.pop("bias", False):
        kwargs["bias"] = np.zeros((8, 8), dtype="float16")
    inputs = _inputs(mask=mask, **kwargs)
    spec = fold_mask(inputs)
    assert choose_implementation(inputs, spec, cuda=True) == want
    assert choose_implementation(inputs, spec, cuda=False) == "xla"
