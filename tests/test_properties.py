"""Property tests: the tiled kernel equals the reference over random calls."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import portattn
from portattn import masks
from portattn._kernels import ReferenceKernel, TiledKernel, tiled_attention
from portattn.testing import assert_close


@st.composite
def calls(draw):
    batch = draw(st.lists(st.integers(1, 2), min_size=0, max_size=2).map(tuple))
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.integers(1, 3))
    lq, lk = draw(st.integers(0, 40)), draw(st.integers(0, 40))
    d, dv = draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from([1, 4, 16]))
    dtype = draw(st.sampled_from(["float64", "float32", "float16"]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in
               ((*batch, hq, lq, d), (*batch, hkv, lk, d), (*batch, hkv, lk, dv)))
    parts = []
    if draw(st.booleans()):
        parts.append(masks.causal(draw(st.sampled_from(["bottom_right", "top_left"]))))
    if draw(st.booleans()):
        parts.append(masks.sliding_window(draw(st.one_of(st.none(), st.integers(0, 8))),
                                          draw(st.one_of(st.none(), st.integers(0, 8)))))
    if draw(st.booleans()):
        parts.append(masks.key_lengths(rng.integers(0, lk + 1, size=batch)))
    if draw(st.booleans()):
        parts.append(masks.query_lengths(rng.integers(0, lq + 1, size=batch)))
    if draw(st.booleans()):
        parts.append(masks.dense(rng.random((lq, lk)) < 0.7))
    mask = None
    for part in parts:
        mask = part if mask is None else mask & part
    kwargs = {"mask": mask, "return_lse": True}
    if draw(st.booleans()):
        kwargs["bias"] = rng.standard_normal((hq, lq, lk)).astype(dtype)
    if draw(st.booleans()):
        kwargs["softcap"] = draw(st.floats(0.5, 20.0))
    blocks = (draw(st.integers(1, 48)), draw(st.integers(1, 48)))
    return (q, k, v), kwargs, blocks


@settings(max_examples=200, deadline=None)
@given(call=calls())
def test_tiled_equals_reference(call):
    args, kwargs, blocks = call
    want_out, want_lse = portattn.attention(*args, kernel=ReferenceKernel.name, **kwargs)
    inputs = portattn._inputs.describe(*args, **kwargs)
    assert not TiledKernel.not_supported_reasons(inputs)
    out, lse = tiled_attention(inputs, *blocks)
    dtype = str(args[0].dtype)
    assert out.dtype == args[0].dtype
    assert not np.isnan(out).any()
    assert not np.isnan(lse).any()
    assert_close(out, want_out.astype(np.float64), dtype, "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    assert_close(lse[finite], want_lse[finite].astype(np.float64), dtype, "lse")
