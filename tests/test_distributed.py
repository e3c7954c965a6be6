"""portattn.distributed on NumPy: layouts, the plan of visible pairs, and both
strategies run by threads (LocalGroup) against one call of the whole sequence."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import distributed, masks
from portattn.autograd import flash_backward
from portattn.distributed import Layout
from portattn.distributed.engine import visible_work

LQ, LK = 13, 13


def _mask_cases(lq, lk):
    ids = np.repeat(np.arange(4), [4, 1, 5, lk - 10])
    dense = np.random.default_rng(5).random((lq, lk)) < 0.6
    return {
        "none": None,
        "causal": masks.causal(),
        "causal_top_left": masks.causal("top_left"),
        "window": masks.sliding_window(3, 1),
        "key_lengths": masks.causal() & masks.key_lengths(np.array([9, lk])),
        "documents": masks.causal() & masks.documents(ids[:lq] if lq == lk else ids,
                                                     None if lq == lk else ids),
        "chunks": masks.causal() & masks.chunks(4),
        "dense": masks.dense(dense),
    }


def _data(lq=LQ, lk=LK, hq=4, hkv=2, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, hq, lq, 8)), rng.standard_normal((2, hkv, lk, 8)),
            rng.standard_normal((2, hkv, lk, 6)))


def _run(q, k, v, size, mask, layout, strategy, softcap=None, dout=None, dlse=None):
    lq, lk = q.shape[-2], k.shape[-2]

    def rank_work(group):
        shards = [distributed.shard(x, group, layout=layout) for x in (q, k, v)]
        out, lse = distributed.attention(*shards, group=group, mask=mask, layout=layout,
                                         strategy=strategy, query_length=lq, key_length=lk,
                                         softcap=softcap, return_lse=True)
        result = [distributed.unshard(out, group, length=lq, layout=layout),
                  distributed.unshard(lse[..., None], group, length=lq, layout=layout)[..., 0]]
        if dout is not None:
            prob = distributed.problem(*shards, rank=group.rank, size=group.size, mask=mask,
                                       layout=layout, query_length=lq, key_length=lk,
                                       softcap=softcap)
            grads = distributed.gradients(
                group, prob, *shards, out, lse,
                distributed.shard(dout, group, layout=layout),
                distributed.shard(dlse[..., None], group, layout=layout)[..., 0],
                strategy=strategy)
            result += [distributed.unshard(g, group, length=n, layout=layout)
                       for g, n in zip(grads, (lq, lk, lk), strict=True)]
        return result

    return distributed.run_local(rank_work, size)[0]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(_mask_cases(LQ, LK)))
def test_forward_and_gradients_match_one_call(case, size, strategy, layout):
    mask = _mask_cases(LQ, LK)[case]
    q, k, v = _data()
    rng = np.random.default_rng(1)
    dout, dlse = rng.standard_normal((2, 4, LQ, 6)), rng.standard_normal((2, 4, LQ))
    out, lse, dq, dk, dv = _run(q, k, v, size, mask, layout, strategy, dout=dout, dlse=dlse)
    want, want_lse = portattn.attention(q, k, v, mask=mask, return_lse=True,
                                        kernel="reference")
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)
    inputs = portattn.explain(q, k, v, mask=mask, kernel="tiled").inputs
    grads = flash_backward(inputs, want, want_lse, dout, dlse)
    for got, expected in zip((dq, dk, dv), grads[:3], strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize(("lq", "lk"), [(7, 19), (19, 7)])
def test_cross_lengths_and_softcap(lq, lk, alignment, strategy):
    q, k, v = _data(lq, lk, hq=2, hkv=1)
    rng = np.random.default_rng(2)
    dout, dlse = rng.standard_normal((2, 2, lq, 6)), rng.standard_normal((2, 2, lq))
    mask = masks.causal(alignment) & masks.sliding_window(6, None)
    out, lse, dq, dk, dv = _run(q, k, v, 3, mask, "zigzag", strategy, softcap=2.0,
                                dout=dout, dlse=dlse)
    want, want_lse = portattn.attention(q, k, v, mask=mask, softcap=2.0, return_lse=True,
                                        kernel="reference")
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    inputs = portattn.explain(q, k, v, mask=mask, softcap=2.0, kernel="tiled").inputs
    grads = flash_backward(inputs, want, want_lse, dout, dlse)
    for got, expected in zip((dq, dk, dv), grads[:3], strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)


def test_float32_keeps_its_dtype_and_precision():
    q, k, v = (x.astype(np.float32) for x in _data())
    out, lse = _run(q, k, v, 4, masks.causal(), "zigzag", "ring")
    assert out.dtype == lse.dtype == np.float32
    want, want_lse = portattn.attention(*(x.astype(np.float64) for x in (q, k, v)),
                                        mask=masks.causal(), return_lse=True)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("length", "size"), [(0, 2), (1, 3), (7, 2), (13, 4), (16, 4), (5, 8)])
def test_layout_round_trip_and_positions(kind, length, size):
    layout = Layout(kind, length, size)
    x = np.arange(2 * length * 3).reshape(2, length, 3)
    shards = [layout.shard(x, r, axis=1) for r in range(size)]
    assert all(s.shape == (2, layout.shard_length, 3) for s in shards)
    np.testing.assert_array_equal(layout.unshard(shards, axis=1), x)
    every = sorted(p for r in range(size) for p in layout.positions(r) if p >= 0)
    assert every == list(range(length))
    for r, s in enumerate(shards):
        for row, p in enumerate(layout.positions(r)):
            expected = x[:, p] if p >= 0 else np.zeros_like(x[:, 0])
            np.testing.assert_array_equal(s[:, row], expected)


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_rank_major_is_the_shards_one_after_another(kind):
    layout = Layout(kind, 11, 3)
    x = np.arange(22).reshape(2, 11)
    laid = layout.rank_major(x, axis=-1)
    n = layout.shard_length
    for r in range(3):
        np.testing.assert_array_equal(laid[:, r * n:(r + 1) * n], layout.shard(x, r, axis=-1))
    np.testing.assert_array_equal(layout.from_rank_major(laid, axis=-1), x)


def test_zigzag_holds_head_and_tail():
    assert Layout("zigzag", 16, 4).positions(0) == [0, 1, 14, 15]
    assert Layout("zigzag", 16, 4).positions(3) == [6, 7, 8, 9]
    assert Layout("contiguous", 10, 4).positions(3) == [8, 9, -1]
    # 11 = 8 chunks of 1 and 3 of them 2 long: the first chunks of ranks 0, 1, 2
    assert Layout("zigzag", 11, 4).chunk_sizes() == [2, 2, 2, 1, 1, 1, 1, 1]


def _work(mask, length, size, kind):
    layout = Layout(kind, length, size)
    bound = None if mask is None else mask.bind(np, (), 1, length, length)
    prob = distributed.engine.Problem(np, 0, layout, layout, bound)
    return visible_work(prob)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_zigzag_balances_causal_and_contiguous_does_not(size):
    length = 1000
    zig = _work(masks.causal(), length, size, "zigzag")
    flat = _work(masks.causal(), length, size, "contiguous")
    assert sum(zig) == sum(flat) == length * (length + 1) // 2
    assert max(zig) / min(zig) <= 1.1
    assert max(flat) / min(flat) > 2


def test_hidden_pairs_are_not_planned():
    layout = Layout("contiguous", 16, 4)
    prob = distributed.engine.Problem(np, 0, layout, layout,
                                      masks.causal().bind(np, (), 1, 16, 16))
    assert [len(prob.pairs(s)) for s in range(4)] == [1, 0, 0, 0]
    assert prob.pairs(0)[0].mask is not None  # the diagonal block keeps its mask
    assert [len(prob.pairs(s, rank=3)) for s in range(4)] == [1, 1, 1, 1]
    assert [p.mask is None for s in range(3) for p in prob.pairs(s, rank=3)] == [True] * 3
    window = masks.sliding_window(3).bind(np, (), 1, 16, 16)
    prob = distributed.engine.Problem(np, 0, layout, layout, window)
    assert [len(prob.pairs(s, rank=3)) for s in range(4)] == [0, 0, 1, 1]


def test_bad_arguments_name_themselves():
    q, k, v = _data()

    def call(group, **kwargs):
        return distributed.attention(q[..., :7, :], k[..., :7, :], v[..., :7, :],
                                     group=group, **kwargs)

    with pytest.raises(ValueError, match=r"strategy=.*'fsdp'"):
        distributed.run_local(lambda g: call(g, strategy="fsdp"), 2)
    with pytest.raises(ValueError, match=r"layout=.*'random'"):
        distributed.run_local(lambda g: call(g, layout="random"), 2)
    with pytest.raises(ValueError, match=r"query.shape\[-2\]=7 .*query_length=20"):
        distributed.run_local(lambda g: call(g, query_length=20), 2)
    with pytest.raises(TypeError, match="group="):
        call(object())
    with pytest.raises(ValueError, match="size=0"):
        Layout("zigzag", 4, 0)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_a_balanced_layout_for_packed_documents(strategy):
    length, size = 61, 3
    ids = np.repeat(np.arange(5), [20, 3, 17, 11, 10])
    mask = masks.causal() & masks.documents(ids)
    layout = Layout.balanced(mask, length, size, chunks_per_rank=4)
    assert sorted(c for held in layout.assignment for c in held) == list(range(12))
    q, k, v = _data(length, length)
    rng = np.random.default_rng(3)
    dout, dlse = rng.standard_normal((2, 4, length, 6)), rng.standard_normal((2, 4, length))
    out, lse, dq, dk, dv = _run(q, k, v, size, mask, layout, strategy, dout=dout, dlse=dlse)
    want, want_lse = portattn.attention(q, k, v, mask=mask, return_lse=True,
                                        kernel="reference")
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    inputs = portattn.explain(q, k, v, mask=mask, kernel="tiled").inputs
    grads = flash_backward(inputs, want, want_lse, dout, dlse)
    for got, expected in zip((dq, dk, dv), grads[:3], strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)


def test_balanced_layouts_even_out_packed_documents():
    length, size = 4096, 4
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, length), 15, replace=False))
    ids = np.repeat(np.arange(16), np.diff(np.concatenate([[0], cuts, [length]])))
    mask = masks.causal() & masks.documents(ids)
    bound = mask.bind(np, (), 1, length, length)
    zig = _work(mask, length, size, "zigzag")
    layout = Layout.balanced(mask, length, size)
    balanced = visible_work(distributed.engine.Problem(np, 0, layout, layout, bound))
    assert sum(balanced) == sum(zig)
    assert max(balanced) / min(balanced) <= 1.1 < max(zig) / min(zig)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("case", ["causal", "documents", "key_lengths", "none"])
def test_ulysses_forward(case, layout):
    mask = _mask_cases(LQ, LK)[case]
    q, k, v = _data()
    out, lse = _run(q, k, v, 2, mask, layout, "ulysses")
    want, want_lse = portattn.attention(q, k, v, mask=mask, return_lse=True,
                                        kernel="reference")
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)


def test_ulysses_needs_heads_that_divide():
    q, k, v = _data(hq=4, hkv=2)
    with pytest.raises(ValueError, match="2 key/value heads"):
        _run(q, k, v, 4, None, "contiguous", "ulysses")
