"""Mask structure: tiles, key ranges, full-tile detection and restriction agree with a
direct evaluation of the definitions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portattn import masks
from portattn.testing import to_numpy


def positions(lq, lk, alignment="bottom_right"):
    offset = lk - lq if alignment == "bottom_right" else 0
    return np.arange(lq)[:, None] + offset, np.arange(lk)[None, :]


def expected(mask_spec, lq, lk):
    kind, *args = mask_spec
    if kind == "causal":
        p, j = positions(lq, lk, args[0])
        return j <= p
    left, right = args
    p, j = positions(lq, lk)
    allowed = np.ones((lq, lk), dtype=bool)
    if left is not None:
        allowed &= j >= p - left
    if right is not None:
        allowed &= j <= p + right
    return allowed


def build(spec):
    kind, *args = spec
    return masks.causal(*args) if kind == "causal" else masks.sliding_window(*args)


SPECS = st.one_of(
    st.tuples(st.just("causal"), st.sampled_from(["bottom_right", "top_left"])),
    st.tuples(st.just("sliding_window"), st.one_of(st.none(), st.integers(0, 12)),
              st.one_of(st.none(), st.integers(0, 12))),
)


def full(xp, mask, lq, lk):
    return np.broadcast_to(to_numpy(mask.tile(xp, 0, lq, 0, lk, lq, lk)), (lq, lk))


@settings(max_examples=150, deadline=None)
@given(spec=SPECS, lq=st.integers(1, 20), lk=st.integers(1, 20), data=st.data())
def test_positional_structure(spec, lq, lk, data):
    xp = pytest.importorskip("array_api_compat.numpy")
    mask = build(spec)
    want = expected(spec, lq, lk)
    np.testing.assert_array_equal(full(xp, mask, lq, lk), want)
    q0 = data.draw(st.integers(0, lq - 1))
    q1 = data.draw(st.integers(q0 + 1, lq))
    k0 = data.draw(st.integers(0, lk - 1))
    k1 = data.draw(st.integers(k0 + 1, lk))
    block = want[q0:q1, k0:k1]
    # covers() may only claim a tile when every pair in it is allowed
    if mask.covers(q0, q1, k0, k1, lq, lk):
        assert block.all()
    # key_range() must contain every key some query of the block may see
    lo, hi = mask.key_range(q0, q1, lq, lk)
    seen = np.flatnonzero(want[q0:q1].any(axis=0))
    assert all(lo <= j < hi for j in seen)
    # restrict() gives the same pairs in the sub-problem's own coordinates
    sub = mask.restrict(xp, q0, q1, k0, k1, lq, lk)
    np.testing.assert_array_equal(full(xp, sub, q1 - q0, k1 - k0), block)


def test_key_range_is_tight_for_causal():
    mask = masks.causal()
    assert mask.key_range(0, 4, 16, 16) == (0, 4)
    assert mask.key_range(12, 16, 16, 16) == (0, 16)
    assert masks.sliding_window(2, 0).key_range(8, 12, 16, 16) == (6, 12)


def test_lengths_restrict_and_tile():
    xp = pytest.importorskip("array_api_compat.numpy")
    lengths = np.array([5, 0, 9])
    mask = masks.key_lengths(lengths)
    tile = to_numpy(mask.tile(xp, 0, 2, 0, 9, 2, 9))
    assert tile.shape == (3, 1, 1, 9)
    np.testing.assert_array_equal(tile[:, 0, 0], np.arange(9)[None, :] < lengths[:, None])
    sub = mask.restrict(xp, 0, 2, 4, 8, 2, 9)
    np.testing.assert_array_equal(to_numpy(sub.lengths), [1, 0, 4])
    q = masks.query_lengths(np.array([3, 1, 0])).restrict(xp, 2, 4, 0, 9, 4, 9)
    np.testing.assert_array_equal(to_numpy(q.lengths), [1, 0, 0])


def test_intersection_flattens_and_names_kinds():
    mask = masks.causal() & masks.sliding_window(4) & masks.key_lengths(np.array([3]))
    assert len(mask.parts) == 3
    assert mask.kinds == {"causal", "sliding_window", "key_lengths"}
    assert repr(mask) == ("causal(bottom_right) & sliding_window(left=4, right=0) & "
                          "key_lengths(shape=(1,))")


def test_equal_positional_masks():
    assert masks.causal() == masks.causal("bottom_right")
    assert masks.causal() != masks.causal("top_left")
    assert len({masks.sliding_window(3, 1), masks.sliding_window(3, 1)}) == 1


def test_dense_restrict_slices():
    xp = pytest.importorskip("array_api_compat.numpy")
    allowed = np.random.default_rng(0).random((2, 1, 6, 7)) < 0.5
    sub = masks.dense(allowed).restrict(xp, 1, 4, 2, 7, 6, 7)
    np.testing.assert_array_equal(to_numpy(sub.allowed), allowed[..., 1:4, 2:7])


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(SPECS, min_size=1, max_size=3), lq=st.integers(1, 20),
       lk=st.integers(1, 20), data=st.data())
def test_band_describes_positional_masks_exactly(specs, lq, lk, data):
    xp = pytest.importorskip("array_api_compat.numpy")
    mask = build(specs[0])
    want = expected(specs[0], lq, lk)
    for spec in specs[1:]:
        mask = mask & build(spec)
        want = want & expected(spec, lq, lk)
    band = mask.band(lq, lk)
    rows, cols = np.arange(lq)[:, None], np.arange(lk)[None, :]
    diff = cols - rows
    in_band = np.ones((lq, lk), dtype=bool)
    if band.lower is not None:
        in_band &= diff >= band.lower
    if band.upper is not None:
        in_band &= diff <= band.upper
    np.testing.assert_array_equal(in_band, want)
    np.testing.assert_array_equal(np.broadcast_to(to_numpy(band.tile(xp, 0, lq, 0, lk)),
                                                  (lq, lk)), want)
    normal = band.normalized(lq, lk)
    np.testing.assert_array_equal(to_numpy(normal.tile(xp, 0, lq, 0, lk)), want)
    q0 = data.draw(st.integers(0, lq - 1))
    q1 = data.draw(st.integers(q0 + 1, lq))
    k0 = data.draw(st.integers(0, lk - 1))
    k1 = data.draw(st.integers(k0 + 1, lk))
    block = want[q0:q1, k0:k1]
    # for positional masks the structure answers exactly, both ways
    assert mask.covers(q0, q1, k0, k1, lq, lk) == bool(block.all())
    assert mask.hides(q0, q1, k0, k1, lq, lk) == (not block.any())


def test_band_of_each_kind():
    assert masks.causal("top_left").band(3, 7) == masks.Band(None, 0)
    assert masks.causal().band(3, 7) == masks.Band(None, 4)
    assert masks.sliding_window(2, 1).band(3, 7) == masks.Band(2, 5)
    assert masks.sliding_window(None, None).band(3, 7) == masks.Band(None, None)
    assert masks.key_lengths(np.array([3])).band(3, 7) is None
    both = masks.causal() & masks.sliding_window(2) & masks.key_lengths(np.array([3]))
    assert both.band(3, 7) == masks.Band(2, 4)
    # restrict() keeps the band in the sub-problem's coordinates
    xp = pytest.importorskip("array_api_compat.numpy")
    assert masks.causal().restrict(xp, 1, 3, 2, 7, 3, 7).band(2, 5) == masks.Band(None, 3)


def test_public_kinds_are_frozen_with_their_parameters():
    import dataclasses

    window = masks.sliding_window(4, 1)
    assert isinstance(window, masks.SlidingWindow)
    assert (window.left, window.right, window.shift) == (4, 1, 0)
    assert masks.causal("top_left").alignment == "top_left"
    lengths = np.array([2, 3])
    part = masks.key_lengths(lengths)
    assert isinstance(part, masks.KeyLengths)
    assert part.lengths is lengths
    with pytest.raises(dataclasses.FrozenInstanceError):
        window.left = 2
    combined = masks.causal() & part
    assert isinstance(combined, masks.Intersection)
    assert combined.parts_of("key_lengths") == (part,)


def test_with_arrays_moves_the_arrays_and_keeps_the_structure():
    mask = (masks.causal() & masks.key_lengths(np.array([2, 3]))
            & masks.dense(np.ones((2, 1, 4, 5), dtype=bool)))
    moved = mask.with_arrays([a[::-1].copy() for a in mask.arrays])
    assert moved.structure() == mask.structure()
    assert moved != mask  # other arrays: not the same mask
    np.testing.assert_array_equal(moved.parts_of("key_lengths")[0].lengths, [3, 2])
    assert moved.parts_of("causal") == mask.parts_of("causal")
    # placeholders (what pytree libraries rebuild with) pass through unchecked
    empty = mask.with_arrays([None, None])
    assert empty.structure() == mask.structure()
    assert empty.arrays == (None, None)
    with pytest.raises(ValueError, match="holds 2 arrays; got 1"):
        mask.with_arrays([None])
