"""A band joined to global tokens (``band | global_tokens(positions)``) runs in three
exact parts merged by their log-sum-exps: the band, the global keys outside each row's
band, the global rows against every key. Each part is checked against the float64
oracle and against the same call through the union's block form."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_numpy import configured

from portattn import attention, masks
from portattn.testing import assert_close, oracle

#: (batch, query heads, key heads, Lq, Lk, band, positions)
CASES = {
    "window_per_batch": ((2,), 4, 2, 61, 70, lambda: masks.sliding_window(6),
                         np.array([[4, 40, -1], [20, 21, 69]])),
    "window_both_sides": ((1,), 2, 2, 300, 300, lambda: masks.sliding_window(20, 3),
                          np.array([0, 5, 150, 150, 299])),
    "causal_two_batch_axes": ((2, 3), 2, 1, 40, 90, lambda: masks.causal(),
                              np.array([0, 89, 60, 60])),
    "band_of_two_top_left": ((1,), 2, 2, 90, 40,
                             lambda: masks.causal("top_left") & masks.sliding_window(5),
                             np.array([0, 39, 20])),
    "tokens_first": ((1,), 3, 3, 128, 128, lambda: masks.sliding_window(16),
                     np.arange(4)),
}


def _inputs(batch, hq, hkv, lq, lk, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((*batch, hq, lq, 16)).astype(dtype),
            rng.standard_normal((*batch, hkv, lk, 16)).astype(dtype),
            rng.standard_normal((*batch, hkv, lk, 8)).astype(dtype))


def _mask(name):
    *_, band, positions = CASES[name]
    return band() | masks.global_tokens(positions)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("name", list(CASES))
def test_three_parts_match_the_oracle_in_float64(name, softcap, threads):
    threads(2)
    batch, hq, hkv, lq, lk, _, _ = CASES[name]
    q, k, v = _inputs(batch, hq, hkv, lq, lk)
    mask = _mask(name)
    out, lse = attention(q, k, v, mask=mask, softcap=softcap, return_lse=True,
                         kernel="numpy_fast")
    want_out, want_lse, _ = oracle(q, k, v, mask=mask, softcap=softcap, return_lse=True)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    assert (np.isneginf(lse) == np.isneginf(want_lse)).all()
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_three_parts_agree_with_the_block_form_in_float32(name):
    batch, hq, hkv, lq, lk, _, _ = CASES[name]
    q, k, v = _inputs(batch, hq, hkv, lq, lk, np.float32, seed=1)
    mask = _mask(name)
    out, lse = attention(q, k, v, mask=mask, return_lse=True, kernel="numpy_fast")
    with configured(split_global_tokens=False):
        whole_out, whole_lse = attention(q, k, v, mask=mask, return_lse=True,
                                         kernel="numpy_fast")
    assert out.dtype == lse.dtype == np.float32
    assert_close(out, whole_out.astype(np.float64), "float32", "out")
    assert_close(lse, whole_lse.astype(np.float64), "float32", "lse")


def _computed(tiles, shape):
    times = np.zeros(shape, int)
    for b, h, q0, q1, k0, k1 in tiles:
        times[(*b, h, slice(q0, q1), slice(k0, k1))] += 1
    return times


@pytest.mark.parametrize("name", ["window_per_batch", "window_both_sides"])
def test_rows_that_are_not_global_compute_each_allowed_pair_once(name, tiles, tiny_tiles):
    batch, hq, hkv, lq, lk, _, positions = CASES[name]
    q, k, v = _inputs(batch, hq, hkv, lq, lk)
    mask = _mask(name)
    attention(q, k, v, mask=mask, kernel="numpy_fast")
    times = _computed(tiles, (*batch, hq, lq, lk))
    allowed = np.broadcast_to(mask.bind(np, batch, hq, lq, lk).tile(
        np, 0, lq, 0, lk, lq, lk), times.shape)
    rows = np.zeros((*batch, hq, lq), bool)  # the global rows (query i at i + Lk - Lq)
    for b in np.ndindex(*batch):
        chosen = positions if positions.ndim == 1 else positions[b]
        chosen = chosen[chosen >= 0] - (lk - lq)
        rows[(*b, slice(None), chosen[(chosen >= 0) & (chosen < lq)])] = True
    columns = np.zeros((*batch, 1, 1, lk), bool)  # the global keys
    for b in np.ndindex(*batch):
        chosen = positions if positions.ndim == 1 else positions[b]
        columns[(*b, 0, 0, chosen[chosen >= 0])] = True
    local = ~rows[..., None] & ~columns
    assert (times[~rows][allowed[~rows]] >= 1).all(), "an allowed pair was skipped"
    assert times[local].max() == 1, "a pair outside the global rows and keys computed twice"
    # a global key's column once more where the band holds it (scores hidden there)
    assert times[~rows[..., None] & columns].max() <= 2
    # the global rows see every key, their band's pairs once more
    assert (times[rows] >= 1).all()
    assert times[rows].max() <= 3


def test_three_parts_compute_fewer_pairs_than_the_block_form(tiles):
    lq = 2048
    positions = np.array([100, 700, 1300, 1900])
    mask = masks.sliding_window(64) | masks.global_tokens(positions)
    q, k, v = _inputs((1,), 2, 2, lq, lq, np.float32)
    attention(q, k, v, mask=mask, kernel="numpy_fast")
    parts = _computed(tiles, (1, 2, lq, lq)).sum()
    tiles.clear()
    with configured(split_global_tokens=False):
        attention(q, k, v, mask=mask, kernel="numpy_fast")
    whole = _computed(tiles, (1, 2, lq, lq)).sum()
    allowed = mask.bind(np, (1,), 2, lq, lq).tile(np, 0, lq, 0, lq, lq, lq).sum() * 2
    assert allowed <= parts < whole


def test_a_row_with_no_key_keeps_zero_and_minus_infinity():
    # batch element 1 has no global token, and its first rows no key in the band
    batch, lq, lk = (2,), 20, 10
    q, k, v = _inputs(batch, 2, 2, lq, lk)
    mask = masks.sliding_window(2) | masks.global_tokens(np.array([[3, -1], [-1, -1]]))
    out, lse = attention(q, k, v, mask=mask, return_lse=True, kernel="numpy_fast")
    want_out, want_lse, _ = oracle(q, k, v, mask=mask, return_lse=True)
    assert np.isneginf(want_lse[1, :, :5]).all()
    assert (np.isneginf(lse) == np.isneginf(want_lse)).all()
    assert (out[1, :, :5] == 0).all()
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)


def test_nan_in_a_global_keys_value_reaches_the_rows_that_see_it():
    batch, hq, hkv, lq, lk, _, positions = CASES["window_both_sides"]
    q, k, v = _inputs(batch, hq, hkv, lq, lk)
    mask = _mask("window_both_sides")
    v[0, 1, 150, 2] = np.nan  # a global key: every row of head 1 sees it
    v[0, 0, 40, 0] = np.nan  # a key in the band of rows 37..60, and of the global rows
    out = attention(q, k, v, mask=mask, kernel="numpy_fast")
    assert np.isnan(out[0, 1]).all()
    sees = np.zeros(lq, bool)
    sees[37:61] = True
    sees[positions] = True
    assert np.isnan(out[0, 0, sees]).all()
    assert not np.isnan(out[0, 0, ~sees]).any()
    clean = v.copy()
    clean[0, 0, 40, 0] = 0
    want = oracle(q, k, clean, mask=mask)[0]
    np.testing.assert_allclose(out[0, 0, ~sees], want[0, 0, ~sees], rtol=1e-12,
                               atol=1e-12)


def test_the_setting_takes_only_true_or_false():
    with pytest.raises(ValueError, match="split_global_tokens must be True or False"), \
            configured(split_global_tokens=1):
        pass
