"""The score tile's memory: rows a cache line apart where 2 KiB apart would collide."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_numpy._exponential import in_place
from portattn_numpy._scores import ScoreTile, row_stride

from portattn import masks

EXP2 = in_place("exp2")


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


def test_a_larger_tile_grows_the_buffer():
    tile = ScoreTile("test.grow", 16, 128, np.float32)
    span, view = tile.scores(64, 512)
    assert view.shape == (64, 512)
    assert span.size == 64 * row_stride(512, 4)
    view[...] = 1.0
    assert tile.exponentiate(EXP2, 64, 512).sum() == 2.0 * 64 * 512


def test_exponentiate_writes_exp_of_the_view_and_keeps_the_padding_finite():
    rng = np.random.default_rng(0)
    tile = ScoreTile("test", 64, 512, np.float32)
    for _ in range(8):  # in place, tile after tile: unchecked padding would reach inf
        span, view = tile.scores(64, 512)
        scores = rng.standard_normal((64, 512)).astype(np.float32)
        view[...] = scores
        weights = tile.exponentiate(EXP2, 64, 512)
        assert np.shares_memory(weights, view)
        np.testing.assert_allclose(weights, np.exp2(scores), rtol=1e-6)
        np.testing.assert_array_equal(span.reshape(64, -1)[:, 512:], 1.0)  # exp2(0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_padded_tiles_give_the_oracle_answer(check, tiles, dtype):
    # 8 heads of 1024 queries: query tiles of 2 KiB (512 float32, 256 float64 rows)
    kwargs = {"mask": masks.sliding_window(700, 0), "softcap": 15.0}
    check((1, 8, 1024, 16), (1, 8, 1024, 16), dv=8, dtype=dtype, **kwargs)
    widest = max(q1 - q0 for _, _, q0, q1, _, _ in tiles)
    assert row_stride(widest, np.dtype(dtype).itemsize) > widest
    bias = np.random.default_rng(1).standard_normal((1024, 1024)).astype(dtype)
    check((1, 8, 1024, 16), (1, 8, 1024, 16), dv=8, dtype=dtype, bias=bias)
