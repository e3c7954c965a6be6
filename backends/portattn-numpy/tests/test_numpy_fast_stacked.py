"""Small heads computed many at a time (``_strategy.Stacked``, ``_stacked``)."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_numpy import _strategy, configured

from portattn import masks


@pytest.fixture
def stacked(results_of):
    return results_of("stacked")


_MASKS = {
    "none": None,
    "causal": masks.causal(),
    "causal_top_left": masks.causal("top_left"),
    "window": masks.sliding_window(4, 2),
    "key_lengths": masks.key_lengths(np.array([23, 0])),
    "query_lengths": masks.query_lengths(np.array([5, 17])) & masks.causal(),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mask", list(_MASKS), ids=list(_MASKS))
def test_matches_the_oracle(check, mask, dtype, stacked):
    # 4 query heads over 2 key/value heads, Lq != Lk, Dv != D
    check((2, 4, 17, 16), (2, 2, 23, 16), dtype=dtype, mask=_MASKS[mask])
    assert stacked
    assert all(stacked)


def test_bias_softcap_and_dense_mask(check, stacked):
    rng = np.random.default_rng(1)
    allowed = rng.random((2, 4, 17, 23)) < 0.5
    allowed[:, :, 3] = False  # rows that attend nothing keep 0 and -inf
    bias = rng.standard_normal((4, 1, 23)).astype(np.float32)
    out, lse = check((2, 4, 17, 16), (2, 4, 23, 16), mask=masks.dense(allowed), bias=bias,
                      softcap=3.0)
    assert not out[:, :, 3].any()
    assert np.isneginf(lse[:, :, 3]).all()
    assert stacked
    assert all(stacked)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_out_of_range_heads_are_redone_carefully(check, dtype, stacked):
    # exp(scores) overflows without the row maximum subtracted
    check((2, 4, 17, 16), (2, 2, 23, 16), dv=16, dtype=dtype, seed=1, mask=masks.causal(),
           scale=400.0)
    assert stacked
    assert not any(stacked)


def test_large_heads_are_not_stacked(check, stacked):
    check((1, 2, 300, 16), (1, 2, 300, 16), mask=masks.causal())
    check((1, 2, 600, 16), (1, 2, 600, 16))
    assert not stacked


@pytest.mark.parametrize("compiled", [True, False])
def test_heads_whose_tiles_run_compiled_are_stacked_only_when_smaller(check, stacked,
                                                                     compiled):
    pytest.importorskip("numba", reason="the compiled blocks need Numba")
    from portattn_numpy import _jit

    if compiled and _jit.load("_compiled_blocks").compiled_blocks(np.float32) is None:
        pytest.skip("this NumPy's BLAS has no cblas_sgemm named for 64-bit integers")
    # 256 x 256 scores are an eighth of a 2 MiB tile: stacked unless tiles run compiled
    with configured(tile_bytes=2 << 20, compiled_blocks=compiled,
                    exponential="exp2_compiled"):
        check((1, 2, 256, 16), (1, 2, 256, 16))
    assert bool(stacked) is not compiled


def test_heads_per_unit():
    tile = 1 << 18
    assert _strategy.heads_per_unit(16, 16, 1, 64, tile) == 64  # all fit in one tile
    assert _strategy.heads_per_unit(64, 64, 4, 64, tile) == 16  # 4 query heads each
    assert _strategy.heads_per_unit(256, 256, 1, 64, tile) == 4  # a quarter tile each
    assert _strategy.heads_per_unit(512, 512, 1, 64, tile) == 0  # too large to stack
    # tiles skip what causal, window and length masks hide: stack only smaller heads
    assert _strategy.heads_per_unit(128, 128, 1, 64, tile, tiles_skip=True) == 16
    assert _strategy.heads_per_unit(256, 256, 1, 64, tile, tiles_skip=True) == 0
    assert _strategy.heads_per_unit(0, 16, 1, 64, tile) == 0  # nothing to compute
    # compiled tiles cost less per call: stack only smaller heads again
    assert _strategy.heads_per_unit(128, 128, 1, 64, tile, tiles_compiled=True) == 16
    assert _strategy.heads_per_unit(256, 256, 1, 64, tile, tiles_compiled=True) == 0
    assert _strategy.heads_per_unit(90, 90, 1, 64, tile, tiles_skip=True,
                                   tiles_compiled=True) == 32
    assert _strategy.heads_per_unit(128, 128, 1, 64, tile, tiles_skip=True,
                                   tiles_compiled=True) == 0
