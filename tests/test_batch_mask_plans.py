"""The tile plans of masks holding arrays never skip an allowed pair: what
``hides``/``covers``/``key_range`` claim agrees with the full boolean mask."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portattn import masks

BATCH = 3


def lengths(draw, high):
    return np.array(draw(st.lists(st.integers(0, high), min_size=BATCH, max_size=BATCH)))


@st.composite
def batch_masks(draw):
    lq, lk = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    parts = []
    for kind in draw(st.lists(st.sampled_from(
            ["key_ranges", "query_ranges", "sequence", "documents", "causal"]),
            min_size=1, max_size=3, unique=True)):
        if kind in ("key_ranges", "query_ranges"):
            high = lk if kind == "key_ranges" else lq
            a, b = lengths(draw, high), lengths(draw, high)
            build = masks.key_ranges if kind == "key_ranges" else masks.query_ranges
            parts.append(build(np.minimum(a, b), np.maximum(a, b)))
        elif kind == "sequence":
            left = draw(st.one_of(st.none(), st.integers(0, 6)))
            parts.append(masks.sequence_window(left, draw(st.integers(0, 3)),
                                               query_lengths=lengths(draw, lq),
                                               key_lengths=lengths(draw, lk)))
        elif kind == "documents":
            def ids(n):
                steps = draw(st.lists(st.integers(0, 1), min_size=BATCH * n,
                                      max_size=BATCH * n))
                out = np.cumsum(np.array(steps).reshape(BATCH, n), axis=1)
                return out - draw(st.integers(0, 1))  # some -1: padding
            parts.append(masks.documents(ids(lq), ids(lk)))
        else:
            parts.append(masks.causal())
    mask = parts[0]
    for p in parts[1:]:
        mask = mask & p
    return mask, lq, lk


def tile(xp, mask, q0, q1, k0, k1, lq, lk, shape):
    allowed = mask.tile(xp, q0, q1, k0, k1, lq, lk)
    # an intersection whose every part covers the tile needs no array: all True
    return np.ones(shape, dtype=bool) if allowed is None else np.broadcast_to(allowed, shape)


@settings(max_examples=300, deadline=None)
@given(case=batch_masks(), data=st.data())
def test_plans_agree_with_the_full_mask(case, data):
    xp = pytest.importorskip("array_api_compat.numpy")
    mask, lq, lk = case
    bound = mask.bind(xp, (BATCH,), 2, lq, lk)
    full = tile(xp, bound, 0, lq, 0, lk, lq, lk, (BATCH, 2, lq, lk))
    q0 = data.draw(st.integers(0, lq - 1))
    q1 = data.draw(st.integers(q0 + 1, lq))
    k0 = data.draw(st.integers(0, lk - 1))
    k1 = data.draw(st.integers(k0 + 1, lk))
    block = full[..., q0:q1, k0:k1]
    if bound.hides(q0, q1, k0, k1, lq, lk):
        assert not block.any()
    if bound.covers(q0, q1, k0, k1, lq, lk):
        assert block.all()
    lo, hi = bound.key_range(q0, q1, lq, lk)
    rows = full[..., q0:q1, :]
    assert not rows[..., :lo].any()
    assert not rows[..., hi:].any()
    # the same mask without its plan (traced arrays) claims nothing it cannot know
    blind = bound.with_arrays(bound.arrays)
    np.testing.assert_array_equal(tile(xp, blind, 0, lq, 0, lk, lq, lk, full.shape), full)
    part = bound.restrict(xp, q0, q1, k0, k1, lq, lk)
    tq, tk = q1 - q0, k1 - k0
    np.testing.assert_array_equal(tile(xp, part, 0, tq, 0, tk, tq, tk, block.shape), block)


@settings(max_examples=60, deadline=None)
@given(case=batch_masks(), block_q=st.integers(1, 8), block_k=st.integers(1, 8))
def test_small_tiles_give_the_reference_result(case, block_q, block_k):
    from portattn._inputs import describe
    from portattn._kernels import reference_attention, tiled_attention

    mask, lq, lk = case
    rng = np.random.default_rng(lq * 31 + lk)
    q = rng.standard_normal((BATCH, 2, lq, 4))
    k, v = rng.standard_normal((2, BATCH, 1, lk, 4))
    inputs = describe(q, k, v, mask=mask, return_lse=True)
    out, lse = tiled_attention(inputs, block_q, block_k)
    want, want_lse, _ = reference_attention(inputs)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
