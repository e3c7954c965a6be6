"""The block form on the chunk grid: the blocks a mask hides are never scheduled, every
kind is exact on uneven chunks, and ALiBi keeps the positions of the whole call without
building it as an array."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from portattn_dask._alibi import aligned_parts, block_alibi
from portattn_dask._layout import bounds

import portattn
from portattn import masks
from portattn.testing import assert_close, oracle
from portattn.testing.conformance import MASK_FUNCTIONS
from portattn.testing.plugin import require_library

da = require_library("dask.array")
dask = require_library("dask")


@pytest.fixture(autouse=True)
def threaded():
    with dask.config.set(scheduler="threads"):
        yield


def scheduled(out):
    """``(*batch, head, query, key)`` chunk indices of the attention blocks in the graph."""
    return {key[1:] for key in dict(out.__dask_graph__())
            if str(key[0]).startswith("attention-block-")}


def visible(mask, shape_q, lk, chunks):
    """The blocks that hold an allowed pair, from the mask's pairs on NumPy."""
    *batch, heads, lq, _ = shape_q
    bound = mask.bind(np, tuple(batch), heads, lq, lk)
    pairs = np.broadcast_to(bound.tile(np, 0, lq, 0, lk, lq, lk), (*batch, heads, lq, lk))
    spans = [bounds(c) for c in chunks]
    found = set()
    for index in np.ndindex(*(len(s) for s in spans)):
        cut = tuple(slice(*s[i]) for s, i in zip(spans, index, strict=True))
        if pairs[cut].any():
            found.add(index)
    return found


def packed_ids(rng, batch, length, documents):
    cuts = np.sort(rng.choice(np.arange(1, length), (batch, documents - 1)), axis=-1)
    return np.stack([np.searchsorted(c, np.arange(length), side="right") for c in cuts])


def masks_for(lib, rng, lk):
    """Masks of the count test, on ``lib`` (numpy or dask.array)."""
    ids = packed_ids(rng, 2, lk, 5)
    return {
        "packed_documents": masks.causal() & masks.documents(lib.asarray(ids)),
        "window_or_global": masks.sliding_window(6, 6) | masks.global_tokens(
            lib.asarray(np.array([[3, -1], [40, -1]]))),
    }


@pytest.mark.parametrize("name", ["packed_documents", "window_or_global"])
@pytest.mark.parametrize("q_chunks", [(16,) * 4, (5, 20, 1, 23, 15)])
def test_hidden_blocks_are_never_scheduled(name, q_chunks):
    shape_q, lk = (2, 4, 64, 8), 64
    k_chunks = (16,) * 4
    chunks = ((1, 1), (2, 2), q_chunks, k_chunks)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape_q) for _ in range(3))
    dq = da.from_array(q, chunks=(*chunks[:3], 8))
    dk, dv = (da.from_array(a, chunks=(1, 2, k_chunks, 8)) for a in (k, v))
    mask = masks_for(np, np.random.default_rng(1), lk)[name]
    lazy = masks_for(da, np.random.default_rng(1), lk)[name]
    out = portattn.attention(dq, dk, dv, mask=lazy, kernel="dask_blockwise")
    want = visible(mask, shape_q, lk, chunks)
    got = scheduled(out)
    assert not got - want, f"hidden blocks scheduled: {sorted(got - want)}"
    assert got == want
    assert len(got) < 2 * 2 * len(q_chunks) * len(k_chunks)  # some blocks are hidden
    assert_close(out, oracle(q, k, v, mask=mask)[0], "float64")


def lib_mask(kind, lib, lq, lk):
    """A mask of each kind, on ``lib``."""
    rng = np.random.default_rng(3)
    ids = packed_ids(rng, 2, lk, 4)
    lengths = np.array([lk // 3, lk - 2])
    layout = rng.random((4, -(-lk // 8), -(-lk // 8))) < 0.4
    return {
        "documents_causal": masks.causal() & masks.documents(
            lib.asarray(ids[:, lk - lq:]), lib.asarray(ids)),
        "global_tokens_window": masks.sliding_window(4, 2) | masks.global_tokens(
            lib.asarray(np.array([[0, lk - 1], [7, -1]]))),
        "prefix_lm": masks.causal() | masks.prefix(lib.asarray(lengths)),
        "sinks_window": masks.causal() & (masks.sliding_window(5) | masks.sink_tokens(3)),
        "chunks": masks.causal() & masks.chunks(9),
        "block_layout": masks.block_layout(lib.asarray(layout), 8) | masks.causal(),
        "function": masks.function(MASK_FUNCTIONS["per_batch_and_head"]),
        "sequence_window": masks.sequence_window(
            6, 1, query_lengths=lib.asarray(np.array([lq, lq // 2])),
            key_lengths=lib.asarray(np.array([lk, lk // 2 + 3]))),
        "key_ranges_dense": masks.key_ranges(lib.asarray(np.array([2, 9])),
                                             lib.asarray(np.array([lk, lk - 4])))
        & masks.dense(lib.asarray(rng.random((2, 1, lq, lk)) < 0.7)),
    }[kind]


KINDS = ["documents_causal", "global_tokens_window", "prefix_lm", "sinks_window", "chunks",
         "block_layout", "function", "sequence_window", "key_ranges_dense"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("lq", "q_chunks", "k_chunks"), [
    (37, (5, 1, 12, 0, 19), (3, 14, 7, 13)),
    (23, (23,), (10, 0, 17, 10)),
])
def test_every_kind_on_uneven_chunks(kind, lq, q_chunks, k_chunks):
    lk = 37
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, lq, 8))
    k, v = (rng.standard_normal((2, 2, lk, 8)) for _ in range(2))
    dq = da.from_array(q, chunks=(1, (1, 3), q_chunks, 8))
    dk, dv = (da.from_array(a, chunks=(2, 1, k_chunks, 4)) for a in (k, v))
    extras = {"alibi_slopes": rng.uniform(0.05, 0.5, (2, 4)), "sinks": rng.uniform(-1, 1, 4)}
    out, lse = portattn.attention(
        dq, dk, dv, mask=lib_mask(kind, da, lq, lk), return_lse=True, kernel="dask_blockwise",
        **{name: da.from_array(a, chunks=1) for name, a in extras.items()})
    want_out, want_lse, _ = oracle(q, k, v, mask=lib_mask(kind, np, lq, lk), **extras)
    assert_close(out, want_out, "float64", "out")
    assert_close(lse, want_lse, "float64", "lse")


@pytest.mark.parametrize(("lq", "lk"), [(37, 37), (9, 40), (40, 9)])
def test_alibi_of_a_block_is_the_whole_calls(lq, lk):
    slopes = np.array([[0.5, 0.125]])
    def spans(length, cuts):
        edges = [0, *(c for c in cuts if 0 < c < length), length]
        return list(pairwise(edges))

    for (q0, q1), (k0, k1) in ((a, b) for a in spans(lq, (4, 5, 16, 30))
                               for b in spans(lk, (7, 9, 18, 31))):
        joined, parts = aligned_parts(q0, q1, k0, k1, lq, lk)
        covered = np.zeros((q1 - q0, k1 - k0), dtype=int)
        for part in parts:
            a0, a1, b0, b1 = part
            covered[a0 - q0:a1 - q0, b0 - k0:b1 - k0] += 1
            rows = np.arange(a0, a1)[:, None] + lk - lq
            want = -slopes[..., None, None] * np.abs(rows - np.arange(b0, b1)[None, :])
            alibi = block_alibi(np, slopes, part, lq, lk, np.float64, None)
            if alibi.slopes is not None:  # the chunk call's own alignment: its formula
                rows = np.arange(a1 - a0)[:, None] + (b1 - b0) - (a1 - a0)
                got = -alibi.slopes[..., None, None] * np.abs(rows - np.arange(b1 - b0)[None, :])
            else:
                assert alibi.bias.shape[-2] == 1  # a row of the bias per head, never more
                got = alibi.bias + alibi.row[..., None]
            np.testing.assert_allclose(got, want, atol=1e-12)
        assert (covered == 1).all()  # the parts tile the block
        if joined == "rows":
            assert all(b0 == k0 and b1 == k1 for _, _, b0, b1 in parts)
        else:
            assert all(a0 == q0 and a1 == q1 for a0, a1, _, _ in parts)


def test_sinks_join_every_query_block_once():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 20, 8)) for _ in range(3))
    sinks = np.array([0.3, -2.0])
    dq, dk, dv = (da.from_array(a, chunks=(1, 1, 10, 8)) for a in (q, k, v))
    out, lse = portattn.attention(dq, dk, dv, mask=masks.causal(), sinks=da.from_array(sinks),
                                  return_lse=True, kernel="dask_blockwise")
    merges = [key for key in dict(out.__dask_graph__())
              if str(key[0]).startswith("attention-merge-")]
    assert len(merges) == 2 * 2  # one per query block, with one key block or two
    want_out, want_lse, _ = oracle(q, k, v, mask=masks.causal(), sinks=sinks)
    assert_close(out, want_out, "float64", "out")
    assert_close(lse, want_lse, "float64", "lse")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_alibi_and_sinks_in_low_precision(dtype):
    lq, lk = 30, 37
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, lq, 16)).astype(dtype)
    k, v = (rng.standard_normal((2, 4, lk, 16)).astype(dtype) for _ in range(2))
    slopes = rng.uniform(0.05, 0.5, 4).astype(dtype)
    sinks = rng.uniform(-1, 1, (2, 4)).astype(dtype)
    dq = da.from_array(q, chunks=(1, 2, (7, 16, 7), 16))
    dk, dv = (da.from_array(a, chunks=(1, 2, (20, 17), 16)) for a in (k, v))
    out, lse = portattn.attention(
        dq, dk, dv, mask=lib_mask("documents_causal", da, lq, lk), return_lse=True,
        alibi_slopes=da.from_array(slopes), sinks=da.from_array(sinks),
        kernel="dask_blockwise")
    assert out.dtype == dtype
    assert lse.dtype == ("float32" if dtype == "float16" else dtype)
    want_out, want_lse, _ = oracle(q, k, v, mask=lib_mask("documents_causal", np, lq, lk),
                                   alibi_slopes=slopes, sinks=sinks)
    assert_close(out, want_out, dtype, "out")
    assert_close(lse, want_lse, dtype, "lse")
