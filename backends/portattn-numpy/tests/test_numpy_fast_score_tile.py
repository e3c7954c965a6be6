"""The score tile's memory (rows a cache line apart where 2 KiB apart would collide),
and the weights made in it."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from portattn_numpy import configured
from portattn_numpy._exponential import in_place, in_rows
from portattn_numpy._loops import Loops
from portattn_numpy._scores import ScoreTile, row_stride

from portattn import masks

_NEEDS_NUMBA = pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                  reason="Numba is not installed")


@pytest.fixture(params=["exp2", pytest.param("exp2_compiled", marks=_NEEDS_NUMBA)])
def loops(request):
    """The loops ``ScoreTile.weights`` runs: NumPy's exp2 (a pass each) or the compiled
    one (one pass)."""
    return Loops(in_place(request.param), in_rows(request.param), compiled=None)


@pytest.mark.parametrize(("rows", "dtype", "stride"), [
    (512, np.float32, 528),    # 2 KiB: one cache line more
    (1024, np.float32, 1040),
    (256, np.float64, 264),
    (256, np.float32, 256),    # 1 KiB apart: measured no slower
    (500, np.float32, 500),
    (0, np.float32, 0),
])
def test_row_stride(rows, dtype, stride):
    assert row_stride(rows, np.dtype(dtype).itemsize) == stride


@pytest.mark.parametrize(("keys", "rows"), [(1024, 512), (37, 512), (1024, 100), (3, 1)])
def test_views_lie_in_their_span(keys, rows):
    tile = ScoreTile("test", 1024, 512, np.float32)
    span, view = tile.scores(keys, rows)
    assert view.shape == (keys, rows)
    assert view.strides == (row_stride(rows, 4) * 4, 4)
    assert span.flags.c_contiguous
    assert span.size == keys * row_stride(rows, 4)
    assert np.shares_memory(span, view)
    view[...] = np.arange(keys * rows).reshape(keys, rows)
    np.testing.assert_array_equal(span.reshape(keys, -1)[:, :rows], view)


def test_a_larger_tile_grows_the_buffer(loops):
    tile = ScoreTile("test.grow", 16, 128, np.float32)
    span, view = tile.scores(64, 512)
    assert view.shape == (64, 512)
    assert span.size == 64 * row_stride(512, 4)
    view[...] = 1.0
    sums = np.empty(512, np.float32)
    assert tile.weights(loops, 64, 512, [], sums).sum() == 2.0 * 64 * 512
    np.testing.assert_array_equal(sums, 2.0 * 64)


def test_weights_are_exp_of_the_view_with_hidden_entries_zero_and_their_sums(loops):
    rng = np.random.default_rng(0)
    tile = ScoreTile("test", 64, 512, np.float32)
    hidden = rng.random((6, 10)) < 0.5  # rows 100:106 by keys 3:13
    wide = rng.random((512, 40)) < 0.1  # every row by keys 20:60
    for _ in range(8):  # in place, tile after tile, over what the last one left
        span, view = tile.scores(64, 512)
        padding = span.reshape(64, -1)[:, 512:].copy()
        scores = rng.standard_normal((64, 512)).astype(np.float32)
        view[...] = scores
        sums = np.empty(512, np.float32)
        weights = tile.weights(loops, 64, 512, [(3, 100, hidden), (20, 0, wide)], sums)
        assert np.shares_memory(weights, view)
        expected = np.exp2(scores)
        expected[3:13, 100:106][hidden.T] = 0  # the tile is keys by rows
        expected[20:60][wide.T] = 0
        np.testing.assert_allclose(weights, expected, rtol=1e-6)
        np.testing.assert_allclose(sums, expected.sum(axis=0), rtol=1e-5)
        after = span.reshape(64, -1)[:, 512:]
        if loops.exponential_rows is None:  # zeroed before NumPy's exp2: never inf
            np.testing.assert_array_equal(after, 1.0)
        else:  # one pass over the rows alone
            np.testing.assert_array_equal(after, padding)


def test_sums_may_go_to_a_strided_column(loops):
    tile = ScoreTile("test", 32, 16, np.float64)
    _, view = tile.scores(32, 16)
    view[...] = np.linspace(-4, 4, 32 * 16).reshape(32, 16)
    expected = np.exp2(view)
    table = np.zeros((16, 3))  # the diagonal's accumulator: values, then the sums
    tile.weights(loops, 32, 16, [], table[:, -1])
    np.testing.assert_allclose(table[:, -1], expected.sum(axis=0), rtol=1e-14)
    np.testing.assert_array_equal(table[:, :-1], 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_padded_tiles_give_the_oracle_answer(check, tiles, dtype):
    # 8 heads of 1024 queries: query tiles of 2 KiB (512 float32, 256 float64 rows)
    kwargs = {"mask": masks.sliding_window(700, 0), "softcap": 15.0}
    with configured(preferred_block_q=2048 // np.dtype(dtype).itemsize):
        check((1, 8, 1024, 16), (1, 8, 1024, 16), dv=8, dtype=dtype, **kwargs)
        widest = max(q1 - q0 for _, _, q0, q1, _, _ in tiles)
        assert row_stride(widest, np.dtype(dtype).itemsize) > widest
        bias = np.random.default_rng(1).standard_normal((1024, 1024)).astype(dtype)
        check((1, 8, 1024, 16), (1, 8, 1024, 16), dv=8, dtype=dtype, bias=bias)
