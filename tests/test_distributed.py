"""portattn.distributed on NumPy: layouts, the plan of visible pairs, and both
strategies run by threads (LocalGroup) against one call of the whole sequence."""

from __future__ import annotations

import threading
import time

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
        # whole-sequence values, checked against the whole call only (not each pair)
        "global_tokens": masks.sliding_window(2) | masks.global_tokens(np.array([0, lk - 1])),
        "sequence_causal": masks.sequence_causal(np.array([lq - 2, lq]), np.array([lk, lk - 4])),
        "sequence_window": masks.sequence_window(
            3, 1, query_lengths=np.array([lq, lq - 3]), key_lengths=np.array([lk - 1, lk])),
        "prefix": masks.causal() | masks.prefix(np.array([lk - 1, 3])),
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


# Ranks that disagree, fail, or never arrive: every rank ends with an error, none waits.

def _ranks(fn, size, *, timeout=30.0, deadline=60.0):
    """What each rank's ``fn(group)`` returned or raised, in rank order; fails the test
    when the ranks have not all finished after ``deadline`` seconds (a hang)."""
    found = {}

    def rank_work(group):
        try:
            found[group.rank] = fn(group)
        except Exception as e:
            found[group.rank] = e

    runner = threading.Thread(target=distributed.run_local,
                              args=(rank_work, size), kwargs={"timeout": timeout}, daemon=True)
    runner.start()
    runner.join(deadline)
    assert not runner.is_alive(), f"ranks still waiting after {deadline} s: {found}"
    return [found.get(r) for r in range(size)]


def _call(q, k, v, group, **kwargs):
    kwargs.setdefault("layout", "contiguous")
    shards = [distributed.shard(x, group, layout=kwargs["layout"]) for x in (q, k, v)]
    return distributed.attention(*shards, group=group, **kwargs)


def _same_error(outcomes, error, *texts):
    assert all(isinstance(o, error) for o in outcomes), outcomes
    assert len({str(o) for o in outcomes}) == 1, outcomes  # one message, on every rank
    for text in texts:
        assert text in str(outcomes[0]), (text, str(outcomes[0]))


def test_ranks_with_other_lengths_fail_together():
    """24 positions over 2 ranks, one rank told 23: the same shards, so the output was
    silently off before; now every rank raises the same error naming both values."""
    q, k, v = _data(24, 24)

    def work(group):
        n = 23 if group.rank == 1 else 24
        return _call(q, k, v, group, query_length=n, key_length=n, mask=masks.causal())

    _same_error(_ranks(work, 2), ValueError, "query_length: 24 on rank 0; 23 on rank 1",
                "key_length: 24 on rank 0; 23 on rank 1")


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_ranks_with_other_masks_fail_together(strategy):
    q, k, v = _data(12, 12, hq=4, hkv=4)

    def work(group):
        mask = masks.causal() if group.rank != 2 else masks.sliding_window(3)
        return _call(q, k, v, group, mask=mask, strategy=strategy)

    _same_error(_ranks(work, 4), ValueError, "mask: causal(bottom_right)",
                "on ranks 0, 1, 3", "sliding_window(left=3, right=0)", "on rank 2")


def test_masks_that_differ_only_in_their_values_disagree():
    q, k, v = _data(12, 12)

    def work(group):
        lengths = np.array([9, 12]) if group.rank == 0 else np.array([9, 11])
        return _call(q, k, v, group, mask=masks.key_lengths(lengths))

    _same_error(_ranks(work, 2), ValueError, "mask: key_lengths(shape=(2,))")


@pytest.mark.parametrize(("what", "text"), [
    ("shard", "query.shape: (2, 4, 6, 8) on rank 0; (2, 4, 5, 8) on rank 1"),
    ("dtype", "key.dtype: float64 on rank 0; float32 on rank 1"),
    ("strategy", "strategy: ring on rank 0; all_gather on rank 1"),
    ("softcap", "softcap: None on rank 0; 2.0 on rank 1"),
])
def test_ranks_with_other_shards_or_options_fail_together(what, text):
    q, k, v = _data(12, 12)

    def work(group):
        shards = [distributed.shard(x, group) for x in (q, k, v)]
        options = {"strategy": "ring"}
        if group.rank == 1:
            if what == "shard":
                shards[0] = shards[0][..., :5, :]
            elif what == "dtype":
                shards = [s.astype(np.float32) for s in shards]
            elif what == "strategy":
                options["strategy"] = "all_gather"
            else:
                options["softcap"] = 2.0
        return distributed.attention(*shards, group=group, **options)

    _same_error(_ranks(work, 2), ValueError, text)


def test_a_rank_that_cannot_start_stops_every_rank():
    """A rank whose own inputs are wrong raises its own error; the others raise one
    that names it, instead of waiting for it in the schedule."""
    q, k, v = _data(12, 12)

    def work(group):
        bad = group.rank == 1
        positions = np.array([0.5]) if bad else np.array([0])
        return _call(q, k, v, group, mask=masks.global_tokens(positions))

    got = _ranks(work, 3)
    assert isinstance(got[1], TypeError), got
    assert "global_tokens positions must have an integer dtype" in str(got[1])
    for other in (got[0], got[2]):
        assert isinstance(other, ValueError), got
        assert "rank 1 of 3 could not start" in str(other)
        assert "global_tokens positions must have an integer dtype" in str(other)


def _fail_mid_schedule(monkeypatch, rank):
    """Rank ``rank`` raises when it reaches another rank's keys."""
    from portattn.distributed._compute import Partials

    original = Partials.add

    def add(self, pair, key, value):
        if self.problem.rank == rank and pair.source != rank:
            msg = "injected failure"
            raise RuntimeError(msg)
        return original(self, pair, key, value)

    monkeypatch.setattr(Partials, "add", add)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_a_rank_raising_mid_schedule_stops_the_others(monkeypatch, strategy):
    """The failing rank raises its own error; the others raise CollectiveError at
    once (threads hear of it), well within the timeout."""
    _fail_mid_schedule(monkeypatch, 1)
    q, k, v = _data(12, 12)

    def work(group):
        out = _call(q, k, v, group, strategy=strategy, timeout=30)
        # the all-gather's forward needs no collective after its gather: the next one
        # (here unshard) is where the others hear of rank 1
        return distributed.unshard(out, group, length=12)

    got = _ranks(work, 3, deadline=20)
    assert isinstance(got[1], RuntimeError), got
    assert str(got[1]) == "injected failure"
    for other in (got[0], got[2]):
        assert isinstance(other, distributed.CollectiveError), got
        assert "rank 1 failed: RuntimeError: injected failure" in str(other)


def test_a_rank_that_never_arrives_times_out():
    q, k, v = _data(12, 12)

    def work(group):
        if group.rank == 1:
            time.sleep(2)  # alive, busy elsewhere: the others give up after 0.5 s
            return None
        return _call(q, k, v, group, timeout=0.5)

    got = _ranks(work, 2, deadline=20)
    assert got[1] is None
    assert isinstance(got[0], distributed.CollectiveError), got
    assert "timeout=0.5" in str(got[0])


def test_timeout_is_checked():
    q, k, v = _data(12, 12)
    got = _ranks(lambda g: _call(q, k, v, g, timeout=-1), 2)
    assert all(isinstance(o, ValueError) for o in got), got
    assert "timeout must be a number of seconds > 0 or None; got timeout=-1" in str(got[0])


@pytest.mark.parametrize("library", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("box", [(0, 6, 0, 6), (0, 6, 0, 13), (6, 13, 0, 6), (7, 13, 5, 13)])
@pytest.mark.parametrize("case", ["global_tokens", "sequence_causal", "sequence_window",
                                  "prefix"])
def test_a_part_keeps_the_whole_sequences_values(case, box, library):
    """A pair of shards restricts a mask that holds whole-sequence values (positions,
    lengths). At the top-left corner of a square call the part has neither shift nor
    origin, and is still a part: its values are not checked against its own lengths,
    and kernels that read the positions directly leave it to the block form."""
    q0, q1, k0, k1 = box
    mask = _mask_cases(LQ, LK)[case]
    q, k, v = _data()
    whole = np.asarray(mask.bind(np, (2,), 4, LQ, LK).tile(np, 0, LQ, 0, LK, LQ, LK))
    allowed = np.broadcast_to(whole, (2, 4, LQ, LK))[..., q0:q1, k0:k1]
    want = portattn.attention(q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :],
                              mask=masks.dense(np.ascontiguousarray(allowed)),
                              kernel="reference")
    arrays = (q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :])
    xp = np
    if library != "numpy":  # torch and jax have kernels of their own for global tokens
        lib = pytest.importorskip(library)
        from array_api_compat import array_namespace

        move = lib.from_numpy if library == "torch" else lib.numpy.asarray
        arrays = [move(np.ascontiguousarray(a)) for a in arrays]
        xp = array_namespace(arrays[0])
        mask = mask.with_arrays([move(np.asarray(a)) for a in mask.arrays])
    part = mask.restrict(xp, q0, q1, k0, k1, LQ, LK)
    got = np.asarray(portattn.attention(*arrays, mask=part))
    tol = 1e-10 if got.dtype == np.float64 else 1e-5  # JAX computes in float32 by default
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(("example", "library"), [("context_parallel_torch.py", "torch"),
                                                  ("context_parallel_jax.py", "jax")])
def test_the_examples_take_strategy_auto(example, library):
    """The README sends people to these scripts; ``strategy="auto"`` is the default of
    the call, so the scripts take it too."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip(library)
    script = Path(__file__).resolve().parents[1] / "docs" / "examples" / example
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "{auto,ring,all_gather,ulysses}" in done.stdout


def test_mask_digests_are_the_same_in_every_process():
    """Ranks compare masks by a digest: it must not depend on the process (Python's
    ``hash`` of a string does, with its random seed)."""
    import os
    import subprocess
    import sys

    code = ("import numpy as np\n"
            "from portattn import masks\n"
            "from portattn.distributed._agree import mask_fingerprint\n"
            "def keep(b, h, q, k):\n"
            "    return q >= k\n"
            "ids = np.repeat(np.arange(3), [4, 4, 5])\n"
            "mask = (masks.causal() & masks.documents(ids)) | masks.global_tokens(np.array([0]))\n"
            "print(mask_fingerprint(mask), mask_fingerprint(masks.function(keep)))\n")
    found = set()
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}, check=True,
                              timeout=120)
        found.add(done.stdout)
    assert len(found) == 1, found
