"""The graph: lazy, linear in the number of blocks, masked blocks left out."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_dask import DaskBlockwiseKernel
from portattn_dask._layout import group_aligned

import portattn
from portattn import masks
from portattn.testing import assert_close, oracle
from portattn.testing.plugin import require_library

da = require_library("dask.array")
dask = require_library("dask")


class ComputeCalled(RuntimeError):
    pass


def refuse(*args, **kwargs):
    msg = "the graph was computed"
    raise ComputeCalled(msg)


@pytest.fixture(autouse=True)
def threaded():
    with dask.config.set(scheduler="threads"):
        yield


def arrays(shape_q, shape_kv, chunks_q, chunks_kv, seed=0, dv=None):
    rng = np.random.default_rng(seed)
    shape_v = (*shape_kv[:-1], dv or shape_kv[-1])
    np_arrays = [rng.standard_normal(s) for s in (shape_q, shape_kv, shape_v)]
    chunks_v = chunks_kv if isinstance(chunks_kv, int) else (*chunks_kv[:-1], -1)
    chunks = (chunks_q, chunks_kv, chunks_v)
    return np_arrays, [da.from_array(a, chunks=c) for a, c in zip(np_arrays, chunks, strict=True)]


def tasks(array, part):
    """Tasks of one kind (block, merge, out, lse) in the graph of ``array``."""
    prefix = f"attention-{part}-"
    return [k for k in dict(array.__dask_graph__()) if k[0].startswith(prefix)]


def test_building_computes_nothing_without_mask_values():
    (q, k, v), (dq, dk, dv) = arrays((4, 4, 24, 8), (4, 2, 30, 8), (2, 2, 6, 4), (1, 1, 7, 8))
    allowed = da.from_array(np.random.default_rng(1).random((24, 30)) < 0.8, chunks=5)
    bias = da.from_array(np.random.default_rng(2).standard_normal((4, 24, 30)), chunks=9)
    sinks = da.from_array(np.linspace(-1, 1, 4), chunks=2)
    mask = masks.causal("top_left") & masks.dense(allowed)  # dense masks are never read
    with dask.config.set(scheduler=refuse):
        out, lse = portattn.attention(dq, dk, dv, mask=mask, bias=bias, sinks=sinks,
                                      return_lse=True, kernel="dask_blockwise")
        assert isinstance(out, da.Array)
        assert isinstance(lse, da.Array)
        with pytest.raises(ComputeCalled):
            out.compute()  # the refusing scheduler really is the one in use
    want = oracle(q, k, v, mask=masks.causal("top_left") & masks.dense(allowed.compute()),
                  bias=bias.compute(), sinks=sinks.compute())
    assert_close(out, want[0], "float64", "out")
    assert_close(lse, want[1], "float64", "lse")


def test_building_reads_the_small_mask_arrays_once(monkeypatch):
    (q, k, v), (dq, dk, dv) = arrays((4, 4, 24, 8), (4, 2, 30, 8), (2, 2, 6, 4), (1, 1, 7, 8))
    lengths = da.from_array(np.array([30, 11, 0, 25]), chunks=1)
    ids = da.from_array(np.repeat([0, 1, 2], 10), chunks=7)
    allowed = da.from_array(np.random.default_rng(1).random((24, 30)) < 0.8, chunks=5)
    mask = (masks.key_lengths(lengths) & masks.dense(allowed)
            & masks.documents(ids[:24], ids))
    computed = []
    compute = dask.compute

    def recording(*collections, **kwargs):
        computed.append(collections)
        return compute(*collections, scheduler="sync")

    monkeypatch.setattr(dask, "compute", recording)
    with dask.config.set(scheduler=refuse):
        out = portattn.attention(dq, dk, dv, mask=mask, kernel="dask_blockwise")
    # one compute, of the lengths and the segment ids: not of q, k, v or the dense mask
    assert len(computed) == 1
    assert len(computed[0]) == 3
    names = {a.name for a in (dq, dk, dv, allowed)}
    read = {key[0] for c in computed[0] for key in dict(c.__dask_graph__())}
    assert not read & names
    monkeypatch.undo()
    want = oracle(q, k, v, mask=masks.key_lengths(np.array([30, 11, 0, 25]))
                  & masks.dense(allowed.compute())
                  & masks.documents(np.repeat([0, 1, 2], 10)[:24], np.repeat([0, 1, 2], 10)))
    assert_close(out, want[0], "float64", "out")


def test_lengths_out_of_range_fail_when_the_graph_is_built():
    _, (dq, dk, dv) = arrays((2, 2, 6, 8), (2, 2, 9, 8), 1, 1)
    lengths = da.from_array(np.array([9, 10]), chunks=1)
    with pytest.raises(ValueError, match=r"key_lengths lengths must lie in \[0, Lk=9\]"):
        portattn.attention(dq, dk, dv, mask=masks.key_lengths(lengths),
                           kernel="dask_blockwise")


@pytest.mark.parametrize("batches", [2, 4, 8])
def test_graph_size_is_linear_in_blocks(batches):
    # batches x 2 heads x 3 query blocks, each over 2 key blocks
    shape_q, shape_kv = (batches, 2, 30, 8), (batches, 2, 20, 8)
    _, (dq, dk, dv) = arrays(shape_q, shape_kv, (1, 1, 10, 8), (1, 1, 10, 8))
    out, lse = portattn.attention(dq, dk, dv, return_lse=True, kernel="dask_blockwise")
    query_blocks = batches * 2 * 3
    assert len(tasks(out, "block")) == query_blocks * 2
    assert len(tasks(out, "merge")) == query_blocks
    assert len(tasks(out, "out")) == query_blocks
    assert len(tasks(lse, "lse")) == query_blocks
    inputs = sum(len(dict(a.__dask_graph__())) for a in (dq, dk, dv))
    assert len(dict(out.__dask_graph__())) == inputs + query_blocks * 4


def test_one_chunk_is_one_task():
    (q, k, v), (dq, dk, dv) = arrays((2, 2, 16, 8), (2, 2, 16, 8), -1, -1)
    out = portattn.attention(dq, dk, dv, kernel="dask_blockwise")
    assert len(tasks(out, "block")) == 1
    assert tasks(out, "merge") == []
    assert_close(out, oracle(q, k, v)[0], "float64")


@pytest.mark.parametrize(("mask", "expected"), [
    (masks.causal(), 1 + 2 + 3 + 4),
    (masks.sliding_window(5, 0), 1 + 2 + 2 + 2),
    (masks.sliding_window(0, 12), 3 + 3 + 2 + 1),
])
def test_masked_blocks_are_not_scheduled(mask, expected):
    (q, k, v), (dq, dk, dv) = arrays((2, 2, 40, 8), (2, 2, 40, 8), (2, 2, 10, 8), (2, 2, 10, 8))
    out = portattn.attention(dq, dk, dv, mask=mask, kernel="dask_blockwise")
    assert len(tasks(out, "block")) == expected
    assert_close(out, oracle(q, k, v, mask=mask)[0], "float64")


def test_query_blocks_reaching_no_key_make_zeros():
    # bottom-right causal with Lq=40 > Lk=9: queries 0..30 see no key at all
    mask = masks.causal("bottom_right")
    (q, k, v), (dq, dk, dv) = arrays((1, 2, 40, 8), (1, 2, 9, 8), (1, 2, 10, 8), (1, 2, 3, 8))
    out, lse = portattn.attention(dq, dk, dv, mask=mask, return_lse=True,
                                  kernel="dask_blockwise")
    # only the last query block (rows 30..39) reaches keys, all three key blocks
    assert len(tasks(out, "block")) == 3
    assert len(tasks(out, "zeros")) == 3
    want_out, want_lse, _ = oracle(q, k, v, mask=mask)
    assert_close(out, want_out, "float64", "out")
    assert_close(lse, want_lse, "float64", "lse")
    assert np.isneginf(lse[..., :30].compute()).all()


@pytest.mark.parametrize(("chunks", "group", "expected"), [
    ((3, 3, 2), 4, (4, 4)),
    ((2, 2, 2), 3, (3, 3)),
    ((1,) * 6, 2, (2, 2, 2)),
    ((5, 1), 6, (6,)),
    ((8,), 8, (8,)),
])
def test_group_aligned(chunks, group, expected):
    assert group_aligned(chunks, group) == expected


def test_grouped_query_chunks_keep_whole_groups():
    (q, k, v), (dq, dk, dv) = arrays((2, 8, 12, 8), (2, 2, 12, 8), (1, 3, 12, 8), (1, 1, 12, 8))
    out = portattn.attention(dq, dk, dv, mask=masks.causal(), kernel="dask_blockwise")
    assert out.chunks[1] == (4, 4)
    assert_close(out, oracle(q, k, v, mask=masks.causal())[0], "float64")


def test_empty_and_uneven_chunks():
    # zero-length key chunks and one-row query chunks
    (q, k, v), (dq, dk, dv) = arrays((2, 2, 5, 8), (2, 2, 13, 8), (1, 1, 1, 8),
                                     ((2,), (2,), (0, 6, 0, 7), (8,)), dv=4)
    out, lse = portattn.attention(dq, dk, dv, mask=masks.sliding_window(3, 1),
                                  return_lse=True, kernel="dask_blockwise")
    want_out, want_lse, _ = oracle(q, k, v, mask=masks.sliding_window(3, 1))
    assert_close(out, want_out, "float64", "out")
    assert_close(lse, want_lse, "float64", "lse")


def test_value_head_dim_chunks_are_joined():
    (q, k, v), _ = arrays((2, 2, 9, 8), (2, 2, 11, 8), -1, -1, dv=6)
    dq, dk = da.from_array(q, chunks=(1, 1, 4, 3)), da.from_array(k, chunks=(1, 1, 4, 5))
    dv = da.from_array(v, chunks=(2, 2, 3, 2))
    out = portattn.attention(dq, dk, dv, kernel="dask_blockwise")
    assert out.chunks[-1] == (6,)
    assert_close(out, oracle(q, k, v)[0], "float64")


def test_forcing_this_kernel_globally_leaves_the_chunks_free(monkeypatch):
    monkeypatch.setenv("PORTATTN_KERNEL", "dask_blockwise")
    (q, k, v), (dq, dk, dv) = arrays((2, 2, 20, 8), (2, 2, 20, 8), (1, 1, 5, 8), (1, 1, 5, 8))
    out = portattn.attention(dq, dk, dv, mask=masks.causal())
    assert len(tasks(out, "block")) > 1
    assert_close(out, oracle(q, k, v, mask=masks.causal())[0], "float64")


def test_unknown_chunk_sizes_are_a_reason():
    _, (dq, dk, dv) = arrays((2, 2, 6, 8), (2, 2, 6, 8), 1, 1)
    ragged = dq[dq[:, 0, 0, 0] > -100]  # boolean indexing: chunk sizes unknown
    inputs = portattn.explain(dq, dk, dv).inputs
    reasons = DaskBlockwiseKernel.not_supported_reasons(inputs._replace(query=ragged))
    assert any("query has unknown chunk sizes" in r for r in reasons)


def test_lengths_without_batch_dims():
    (q, k, v), (dq, dk, dv) = arrays((2, 9, 8), (2, 11, 8), (1, 4, 8), (1, 4, 8))

    def mask(lib):
        return masks.key_lengths(lib.asarray(7)) & masks.query_lengths(lib.asarray(5))

    out, lse = portattn.attention(dq, dk, dv, mask=mask(da), return_lse=True,
                                  kernel="dask_blockwise")
    want_out, want_lse, _ = oracle(q, k, v, mask=mask(np))
    assert_close(out, want_out, "float64", "out")
    assert_close(lse, want_lse, "float64", "lse")
