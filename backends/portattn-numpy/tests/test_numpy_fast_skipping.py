"""Tiles the mask rules out are never computed (seen through the ``on_tile`` hook)."""

from __future__ import annotations

import numpy as np
import pytest

from portattn import attention, masks
from portattn.testing import assert_close, oracle


def _run(lq=64, lk=64, batch=(2,), heads=2, **kwargs):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((*batch, heads, lq, 8)).astype(np.float32)
    k = rng.standard_normal((*batch, heads, lk, 8)).astype(np.float32)
    out = attention(q, k, k, kernel="numpy_fast", **kwargs)
    assert_close(out, oracle(*(a.astype(np.float64) for a in (q, k, k)), **kwargs)[0],
                 "float32", "out")


def _pairs(tiles) -> int:
    """Query-key pairs covered by the computed tiles."""
    return sum((q1 - q0) * (k1 - k0) for *_, q0, q1, k0, k1 in tiles)


def _allowed_pairs(mask, lq, lk) -> int:
    return int(np.broadcast_to(mask.tile(np, 0, lq, 0, lk, lq, lk), (lq, lk)).sum())


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize(("lq", "lk"), [(40, 64), (64, 40)])
def test_causal_skips_tiles_above_the_diagonal(alignment, lq, lk, tiles, tiny_tiles):
    mask = masks.causal(alignment)
    _run(lq, lk, mask=mask)
    offset = lk - lq if alignment == "bottom_right" else 0
    assert tiles
    for *_, q1, k0, _k1 in tiles:
        assert k0 <= q1 - 1 + offset, "a tile with no allowed pair was computed"
    # every allowed pair, plus at most the rest of a 4-row query tile along the diagonal
    allowed = 2 * 2 * _allowed_pairs(mask, lq, lk)
    assert allowed <= _pairs(tiles) <= allowed + 2 * 2 * lq * 4


def test_sliding_window_computes_only_the_band(tiles, tiny_tiles):
    _run(mask=masks.sliding_window(5, 2))
    for *_, q0, q1, k0, k1 in tiles:
        assert k0 <= q1 - 1 + 2
        assert k1 - 1 >= q0 - 5
    assert _pairs(tiles) < 0.5 * 2 * 2 * 64 * 64


def test_lengths_skip_padding(tiles, tiny_tiles):
    key_len, query_len = np.array([0, 30]), np.array([64, 17])
    _run(mask=masks.key_lengths(key_len) & masks.query_lengths(query_len))
    assert {b for b, *_ in tiles} == {(1,)}  # batch 0 has no keys at all
    for _b, _h, q0, _q1, k0, _k1 in tiles:
        assert k0 < 30
        assert q0 < 17
    assert _pairs(tiles) <= 2 * 17 * 30 + 2 * 8 * 30  # + one partial tile per head


def test_dense_blocks_with_nothing_allowed_are_skipped(tiles, tiny_tiles):
    allowed = np.ones((64, 64), bool)
    allowed[:, 8:40] = False  # four whole key blocks of 8
    _run(mask=masks.dense(allowed))
    assert tiles
    assert not any(k0 >= 8 and k1 <= 40 for *_, k0, k1 in tiles)


def test_no_mask_computes_everything(tiles, tiny_tiles):
    # the counterpart of the tests above: without a mask every pair is computed once
    _run()
    assert _pairs(tiles) == 2 * 2 * 64 * 64
