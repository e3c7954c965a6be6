"""Packed documents: every document equals attending it alone, across the tiles of
other documents nothing is computed, and gradients flow as for separate sequences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portattn
from portattn import masks
from portattn.testing import assert_close, oracle


def packed(rng, lengths, rows=2, hq=4, hkv=2, d=8):
    """Row ``r`` packs documents of ``lengths[r]``; ids ``(rows, L)``, padding -1."""
    total = max(sum(n) for n in lengths)
    ids = np.full((rows, total), -1, dtype=np.int64)
    for r, ns in enumerate(lengths):
        ids[r, :sum(ns)] = np.repeat(np.arange(len(ns)), ns)
    q = rng.standard_normal((rows, hq, total, d))
    k = rng.standard_normal((rows, hkv, total, d))
    v = rng.standard_normal((rows, hkv, total, d + 1))
    return ids, q, k, v


def each_alone(ids, q, k, v, causal):
    want = np.zeros((*q.shape[:-1], v.shape[-1]))
    for r in range(ids.shape[0]):
        for doc in np.unique(ids[r][ids[r] >= 0]):
            at = np.flatnonzero(ids[r] == doc)
            want[r][:, at] = oracle(q[r][:, at], k[r][:, at], v[r][:, at],
                                    mask=masks.causal() if causal else None)[0]
    return want


LENGTHS = [(5, 17, 1, 9), (12, 12, 4)]


@pytest.mark.parametrize("kernel", [None, "tiled", "reference"])
@pytest.mark.parametrize("causal", [True, False])
def test_documents_equal_each_document_alone(backend, kernel, causal):
    ids, q, k, v = packed(np.random.default_rng(0), LENGTHS)
    mask = masks.documents(backend.asarray(ids))
    if causal:
        mask = masks.causal() & mask
    a = [backend.asarray(x, "float32") for x in (q, k, v)]
    got = portattn.attention(*a, mask=mask, kernel=kernel)
    assert_close(got, each_alone(ids, q, k, v, causal), "float32")


def test_cu_seqlens_give_the_same_ids(backend):
    cu = np.array([[0, 5, 22, 23, 32], [0, 12, 24, 28, 28]])
    ids = masks.documents_from_cu_seqlens(backend.asarray(cu), 32).query_ids
    want, _, _, _ = packed(np.random.default_rng(0), LENGTHS)
    np.testing.assert_array_equal(backend.to_numpy(ids), want)


def test_one_row_of_ids_is_shared_by_the_batch(backend):
    ids, q, k, v = packed(np.random.default_rng(1), [(6, 10)], rows=1)
    q, k, v = (np.repeat(x, 3, axis=0) for x in (q, k, v))
    a = [backend.asarray(x, "float32") for x in (q, k, v)]
    got = portattn.attention(*a, mask=masks.causal() & masks.documents(backend.asarray(ids[0])))
    assert_close(got, each_alone(np.repeat(ids, 3, axis=0), q, k, v, True), "float32")


def test_tiles_across_documents_are_skipped():
    xp = pytest.importorskip("array_api_compat.numpy")
    ids = np.repeat(np.arange(4), 64)[None]  # 4 documents of 64 in one row of 256
    mask = (masks.causal() & masks.documents(ids)).bind(xp, (1,), 1, 256, 256)
    assert mask.key_range(64, 96, 256, 256) == (64, 96)
    assert mask.key_range(128, 192, 256, 256) == (128, 192)
    assert mask.hides(128, 192, 0, 128, 256, 256)
    assert not mask.hides(128, 192, 100, 140, 256, 256)
    assert mask.parts_of("documents")[0].covers(128, 192, 128, 192, 256, 256)
    traced = mask.with_arrays(mask.arrays)  # other arrays: no plan, every tile visited
    assert traced.key_range(128, 192, 256, 256) == (0, 192)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_tile_is_covered_exactly_when_all_its_pairs_are_allowed(data):
    # several batch elements, padding and ids in any order: a tile is full only where
    # every batch element allows every pair of it
    rows = data.draw(st.integers(1, 3))
    length = data.draw(st.integers(1, 24))
    ids = st.lists(st.integers(-1, 3), min_size=length, max_size=length)
    query_ids = np.array([data.draw(ids) for _ in range(rows)])
    key_ids = np.array([data.draw(ids) for _ in range(rows)])
    xp = pytest.importorskip("array_api_compat.numpy")
    mask = masks.documents(query_ids, key_ids).bind(xp, (rows,), 1, length, length)
    q0 = data.draw(st.integers(0, length - 1))
    q1 = data.draw(st.integers(q0 + 1, length))
    k0 = data.draw(st.integers(0, length - 1))
    k1 = data.draw(st.integers(k0 + 1, length))
    q, k = query_ids[:, q0:q1, None], key_ids[:, None, k0:k1]
    every_pair = bool(((q == k) & (q >= 0)).all())
    assert mask.covers(q0, q1, k0, k1, length, length) == every_pair


def test_padding_ids_attend_nothing():
    ids = np.array([[0, 0, 1, -1, -1]])
    q = np.random.default_rng(2).standard_normal((1, 1, 5, 4))
    out, lse = portattn.attention(q, q, q, mask=masks.documents(ids), return_lse=True)
    np.testing.assert_array_equal(out[0, 0, 3:], 0)
    assert np.isneginf(lse[0, 0, 3:]).all()


def test_gradients_equal_the_reference():
    torch = pytest.importorskip("torch")
    ids, q, k, v = packed(np.random.default_rng(3), LENGTHS)
    grads = []
    for kernel in ("tiled", "reference"):
        a = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        mask = masks.causal() & masks.documents(torch.tensor(ids))
        out = portattn.attention(*a, mask=mask, kernel=kernel)
        (out * torch.tensor(np.cos(np.arange(out.numel())).reshape(out.shape))).sum().backward()
        grads.append([x.grad.numpy() for x in a])
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("ids", "key_ids", "error", "text"), [
    (np.zeros(5), None, TypeError,
     "documents query_ids must have an integer dtype; got query_ids.dtype=float64"),
    (np.zeros((2, 5), dtype=np.int64), None, ValueError,
     "documents query_ids must have shape (Lq,) = (6,) or (*batch, Lq) = (1, 6); "
     "got query_ids.shape=(2, 5)"),
    (np.zeros(6, dtype=np.int64), np.zeros(7, dtype=np.int64), ValueError,
     "documents key_ids must have shape (Lk,) = (6,)"),
])
def test_bad_ids_name_the_argument(ids, key_ids, error, text):
    q = np.zeros((1, 1, 6, 2))
    with pytest.raises(error) as info:
        portattn.attention(q, q, q, mask=masks.documents(ids, key_ids))
    assert text in str(info.value)


def test_bad_cu_seqlens():
    with pytest.raises(ValueError, match=r"cu_seqlens must be an integer array"):
        masks.documents_from_cu_seqlens(np.array([0.0, 3.0]), 3)


def test_under_jax_jit_the_ids_are_traced_and_the_result_the_same():
    jax = pytest.importorskip("jax")
    # portattn-jax registers masks as pytrees, so they can be jit arguments
    pytest.importorskip("portattn_jax")
    jnp = jax.numpy
    ids, q, k, v = packed(np.random.default_rng(4), LENGTHS)
    a = [jnp.asarray(x, dtype=jnp.float32) for x in (q, k, v)]
    portattn.kernels()  # loads portattn-jax, which makes masks pytrees from then on
    mask = masks.causal() & masks.documents(jnp.asarray(ids))
    want = each_alone(ids, q, k, v, True)
    for kernel in (None, "tiled"):
        run = jax.jit(lambda q, k, v, m, kernel=kernel: portattn.attention(
            q, k, v, mask=m, kernel=kernel))
        assert_close(run(*a, mask), want, "float32")
