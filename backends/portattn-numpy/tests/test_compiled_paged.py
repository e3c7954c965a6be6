"""Decode steps on paged keys, compiled: the same answers as portattn's portable paged
attention, garbage in unused page slots never read, and a sequence's bits independent
of its batch."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import masks

pytest.importorskip("numba", reason="the compiled paged decode needs Numba (portattn-numpy[jit])")

from portattn_numpy import get_num_threads
from portattn_numpy._compiled_paged import paged_forward, work_items

HQ, HKV, D, DV = 4, 2, 8, 6
#: Each mask, and the band of key offsets it is to the compiled loop.
MASKS = {
    "none": (None, (None, None)),
    "causal": (masks.causal(), (None, 0)),
    "causal_window": (masks.causal() & masks.sliding_window(3), (-3, 0)),
    "window": (masks.sliding_window(5, 2), (-5, 2)),
}


def _batch(rng, dtype, page, head_major, lengths, counts):
    """Random pools with NaN in every slot no sequence uses, a shuffled block table
    (-1 past each length) and queries packed by ``counts``."""
    lengths, counts = np.asarray(lengths, np.int64), np.asarray(counts, np.int64)
    width = max(1, max(-(-int(n) // page) for n in lengths))
    pages = [-(-int(n) // page) for n in lengths]
    order = rng.permutation(sum(pages) + 3)  # a few pages no sequence owns
    table = np.full((len(lengths), width), -1, np.int32)
    shape = (len(order), HKV, page) if head_major else (len(order), page, HKV)
    key_pages = np.full((*shape, D), np.nan, dtype)
    value_pages = np.full((*shape, DV), np.nan, dtype)
    used = 0
    for s, n in enumerate(lengths):
        table[s, :pages[s]] = order[used:used + pages[s]]
        used += pages[s]
        for j in range(n):
            slot, at = table[s, j // page], j % page
            index = (slot, slice(None), at) if head_major else (slot, at)
            key_pages[index] = rng.standard_normal((HKV, D))
            value_pages[index] = rng.standard_normal((HKV, DV))
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    query = rng.standard_normal((int(starts[-1]), HQ, D)).astype(dtype)
    return query, key_pages, value_pages, table, starts, lengths


def _oracle(batch, mask, head_major, **options):
    """portattn's portable paged loop."""
    query, key_pages, value_pages, table, starts, lengths = batch
    with portattn.disable_kernels("numpy_fast"):
        return portattn.paged_attention(
            query, key_pages, value_pages, block_table=table, key_lengths=lengths,
            query_starts=starts, mask=mask, return_lse=True,
            layout="bhld" if head_major else "blhd", **options)


def _compiled(batch, band, head_major, scale, softcap=None, alibi_slopes=None, sinks=None):
    query, key_pages, value_pages, table, starts, lengths = batch
    return paged_forward(query, key_pages, value_pages, head_major, table, starts, lengths,
                        *band, scale, softcap, alibi_slopes, sinks, get_num_threads())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("head_major", [False, True], ids=["blhd", "bhld"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("extras", ["plain", "softcap", "alibi", "sinks"])
def test_the_compiled_decode_matches_portable_paged_attention(dtype, page, head_major,
                                                              mask_name, extras):
    rng = np.random.default_rng(7)
    # Sequence 1 is empty (no keys, no queries); 2 has one key; 4 is long.
    lengths, counts = [9, 0, 1, 40, 150, 17], [1, 0, 1, 4, 3, 2]
    batch = _batch(rng, dtype, page, head_major, lengths, counts)
    mask, band = MASKS[mask_name]
    options = {"scale": 0.4}
    if extras == "softcap":
        options["softcap"] = 1.5
    elif extras == "alibi":
        options["alibi_slopes"] = rng.uniform(0.01, 0.5, (len(lengths), HQ))
    elif extras == "sinks":
        options["sinks"] = rng.standard_normal((len(lengths), HQ))
    out, lse = _compiled(batch, band, head_major, **options)
    expected_out, expected_lse = _oracle(batch, mask, head_major, **options)
    assert out.dtype == lse.dtype == dtype
    assert out.shape == expected_out.shape
    assert lse.shape == expected_lse.shape
    assert np.isfinite(out).all()  # the NaN in unused slots never reaches a row
    np.testing.assert_allclose(out, expected_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, expected_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("sinks", [False, True])
def test_rows_that_see_no_key_give_zero_and_their_sink(sinks):
    rng = np.random.default_rng(1)
    batch = _batch(rng, np.float32, 4, False, [6], [2])
    sink_logits = rng.standard_normal((1, HQ)) if sinks else None
    # Keys 2 and more ahead of each query: positions 4 and 5 see none.
    out, lse = _compiled(batch, (2, None), False, 0.5, sinks=sink_logits)
    assert (out == 0).all()
    expected = sink_logits[0, :, None].repeat(2, 1) if sinks else np.full((HQ, 2), -np.inf)
    np.testing.assert_allclose(lse, expected, rtol=1e-6)


@pytest.mark.parametrize("where", ["key", "value"])
def test_a_non_finite_key_poisons_only_the_rows_that_see_it(where):
    rng = np.random.default_rng(2)
    page = 4
    batch = _batch(rng, np.float64, page, False, [10], [3])
    _, key_pages, value_pages, table, _, _ = batch
    pool = key_pages if where == "key" else value_pages
    pool[table[0, 8 // page], 8 % page, 0, 1] = np.inf  # key 8 of kv head 0
    out, _ = _compiled(batch, (None, 0), False, 0.5)  # causal: positions 7, 8, 9
    group = HQ // HKV
    assert np.isfinite(out[0]).all()  # position 7 does not see key 8
    assert np.isnan(out[1:, :group]).all()  # the heads that read kv head 0
    assert np.isfinite(out[1:, group:]).all()


@pytest.mark.parametrize("head_major", [False, True], ids=["blhd", "bhld"])
def test_a_sequence_gives_the_same_bits_alone_and_in_a_batch(head_major):
    rng = np.random.default_rng(3)
    lengths, counts = [300, 5, 77, 1024, 2, 64, 500, 33], [1, 2, 4, 1, 2, 3, 1, 4]
    batch = _batch(rng, np.float32, 16, head_major, lengths, counts)
    query, key_pages, value_pages, table, starts, lengths = batch
    alone = (query[:1], key_pages, value_pages, table[:1], starts[:2], lengths[:1])
    options = {"scale": 0.3, "softcap": 3.0}
    out, lse = _compiled(batch, (-100, 0), head_major, **options)
    out_alone, lse_alone = _compiled(alone, (-100, 0), head_major, **options)
    np.testing.assert_array_equal(out[:1], out_alone)
    np.testing.assert_array_equal(lse[:, :1], lse_alone)


def test_a_query_that_is_not_contiguous_is_read_as_it_is():
    rng = np.random.default_rng(4)
    query, *rest = batch = _batch(rng, np.float32, 16, False, [20, 30], [2, 1])
    strided = np.asfortranarray(query)
    out, lse = _compiled((strided, *rest), (None, None), False, 0.25)
    expected_out, expected_lse = _compiled(batch, (None, None), False, 0.25)
    np.testing.assert_array_equal(out, expected_out)
    np.testing.assert_array_equal(lse, expected_lse)


@pytest.mark.parametrize("page", [16, 512])  # 512: whole chunks read in place
@pytest.mark.parametrize("head_major", [False, True], ids=["blhd", "bhld"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_prompts_longer_than_a_tile_match_portable_paged_attention(head_major, mask_name,
                                                                   page):
    # 150 queries: tiles of 64, 64 and 22; keys in three chunks of 256 and more
    rng = np.random.default_rng(5)
    lengths, counts = [700, 300, 9, 64], [150, 70, 9, 64]
    batch = _batch(rng, np.float32, page, head_major, lengths, counts)
    mask, band = MASKS[mask_name]
    options = {"scale": 0.3, "alibi_slopes": rng.uniform(0.01, 0.1, (len(lengths), HQ))}
    out, lse = _compiled(batch, band, head_major, **options)
    expected_out, expected_lse = _oracle(batch, mask, head_major, **options)
    np.testing.assert_allclose(out, expected_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, expected_lse, rtol=2e-5, atol=2e-5)


def test_work_items_are_cut_by_the_sequence_alone():
    items = work_items(np.array([0, 1, 1, 131]), 2, 1)
    # sequence 0: one query; 1: none; 2: 130 queries in tiles of 64, 64, 2
    assert items.tolist() == [[0, 0, 0, 1], [0, 1, 0, 1],
                              [2, 0, 0, 64], [2, 1, 0, 64], [2, 0, 64, 128],
                              [2, 1, 64, 128], [2, 0, 128, 130], [2, 1, 128, 130]]
    # both heads in one item (token-major pages)
    assert work_items(np.array([0, 1, 1, 131]), 2, 2).tolist() == [
        [0, 0, 0, 1], [2, 0, 0, 64], [2, 0, 64, 128], [2, 0, 128, 130]]


def test_a_pool_that_is_a_strided_view_is_read_in_place():
    rng = np.random.default_rng(6)
    query, key_pages, value_pages, *rest = _batch(rng, np.float64, 512, True, [600, 40],
                                                  [3, 1])
    # the same pools, each a view whose rows lie two rows apart
    wide_keys = np.zeros((*key_pages.shape[:3], 2, D))
    wide_values = np.zeros((*value_pages.shape[:3], 2, DV))
    wide_keys[..., 0, :], wide_values[..., 0, :] = key_pages, value_pages
    views = (query, wide_keys[..., 0, :], wide_values[..., 0, :], *rest)
    out, lse = _compiled(views, (None, 0), True, 0.5)
    expected_out, expected_lse = _compiled((query, key_pages, value_pages, *rest), (None, 0),
                                           True, 0.5)
    np.testing.assert_allclose(out, expected_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("head_major", [False, True], ids=["blhd", "bhld"])
@pytest.mark.parametrize("extras", ["plain", "softcap"])
def test_one_row_per_head_matches_portable_paged_attention(head_major, extras):
    # as many query heads as key/value heads, one query each: a head's products are
    # matrix-vector ones
    rng = np.random.default_rng(8)
    query, *rest = _batch(rng, np.float32, 16, head_major, [300, 9, 1, 700], [1, 1, 1, 1])
    batch = (query[:, :HKV], *rest)
    options = {"scale": 0.3, **({"softcap": 2.0} if extras == "softcap" else {})}
    out, lse = _compiled(batch, (None, None), head_major, **options)
    expected_out, expected_lse = _oracle(batch, None, head_major, **options)
    np.testing.assert_allclose(out, expected_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, expected_lse, rtol=2e-5, atol=2e-5)
