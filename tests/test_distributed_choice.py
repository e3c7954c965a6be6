"""portattn.distributed's ``strategy="auto"`` and ``explain``: the rule picks each
strategy where it says, gives its reasons, and runs what it picked."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import distributed, masks
from portattn._lib import _plugins as _wiring
from portattn.distributed import _api, _choice


def _shards(length, hq, hkv, size, d=64, dtype=np.float32):
    """Shard-shaped arrays that hold no memory (explain reads shapes only)."""
    shard = length // size
    q = np.broadcast_to(np.zeros((), dtype), (1, hq, shard, d))
    kv = np.broadcast_to(np.zeros((), dtype), (1, hkv, shard, d))
    return q, kv, kv


def test_one_rank_runs_the_ring():
    choice = distributed.explain(*_shards(32768, 8, 8, 1), size=1)
    assert choice.strategy == "ring"
    assert "one rank" in choice.why


def test_a_small_whole_kv_is_gathered():
    # 4 ranks x (8 heads x 256 positions x 128 floats) = 4 MiB of K/V
    choice = distributed.explain(*_shards(1024, 8, 8, 4), size=4, mask=masks.causal())
    assert choice.strategy == "all_gather"
    assert "at most 4.0 MiB" in choice.why
    # twice as long: past the budget, and ulysses can run
    assert distributed.explain(*_shards(2048, 8, 8, 4), size=4).strategy == "ulysses"


def test_few_kv_heads_are_gathered():
    # 8 query heads per K/V head: the whole K/V (32 MiB) is the size of a rank's
    # queries and output, over the byte budget
    choice = distributed.explain(*_shards(65536, 8, 1, 8), size=8, mask=masks.causal())
    assert choice.strategy == "all_gather"
    assert "few K/V heads" in choice.why
    # with more ranks the whole K/V outgrows a rank's queries: ulysses cannot split
    # one K/V head, so the ring
    choice = distributed.explain(*_shards(65536, 8, 1, 16), size=16, mask=masks.causal())
    assert choice.strategy == "ring"
    assert "1 key/value heads" in choice.why


def test_ulysses_when_heads_divide_and_it_sends_less():
    choice = distributed.explain(*_shards(32768, 8, 8, 4), size=4, mask=masks.causal(),
                                 layout="zigzag")
    assert choice.strategy == "ulysses"
    assert choice.option("ulysses").sends < choice.option("ring").sends
    assert choice.option("ulysses").reasons == ()


def test_two_ranks_of_mha_keep_the_ring():
    # ulysses sends as much as the ring with two ranks of as many K/V as query heads
    choice = distributed.explain(*_shards(32768, 8, 8, 2), size=2)
    assert choice.strategy == "ring"
    assert choice.option("ulysses").reasons == ()
    assert "ulysses would send" in choice.why


def test_heads_that_do_not_divide_keep_the_ring():
    choice = distributed.explain(*_shards(32768, 8, 8, 3), size=3)
    assert choice.strategy == "ring"
    assert "8 query heads and 8 key/value heads" in choice.option("ulysses").reasons[0]


@pytest.mark.parametrize("kind", ["dense", "function", "union"])
def test_masks_that_vary_by_head_keep_the_ring(kind):
    length = 32768
    by_head = masks.dense(np.broadcast_to(np.ones((), bool), (8, length, length)))
    mask = {"dense": by_head,
            "function": masks.function(lambda b, h, q, k: (q >= k) & (h > 0)),
            "union": masks.causal() & (masks.sliding_window(8) | by_head)}[kind]
    choice = distributed.explain(*_shards(length, 8, 8, 4), size=4, mask=mask)
    assert choice.strategy == "ring"
    reasons = choice.option("ulysses").reasons
    assert len(reasons) == 1
    assert "varies by head" in reasons[0] or "head index" in reasons[0]
    # a mask the same for every head leaves ulysses to the rule
    same = masks.dense(np.broadcast_to(np.ones((), bool), (1, length, length)))
    assert distributed.explain(*_shards(length, 8, 8, 4), size=4,
                               mask=same).strategy == "ulysses"


def test_bytes_each_rank_sends_and_holds():
    q, k, v = _shards(4096, 4, 2, 4, d=32, dtype=np.float16)
    choice = distributed.explain(q, k, v, size=4)
    kv = 2 * 1024 * 64 * 2  # one rank's K and V shards: heads x positions x (d + dv) x 2 B
    assert choice.option("ring").sends == choice.option("all_gather").sends == 3 * kv
    assert choice.option("ring").holds == kv * 5 // 4  # in use, and a piece arriving
    assert choice.option("all_gather").holds == 4 * kv
    qo = 4 * 1024 * 64 * 2
    lse = 4 * 1024 * 4  # float32 for half precision
    assert choice.option("ulysses").sends == round(0.75 * (qo + kv + lse))


def test_the_report_lists_every_strategy():
    choice = distributed.explain(*_shards(24576, 8, 8, 3), size=3, mask=masks.causal(),
                                 layout="zigzag")
    text = str(choice)
    assert text.splitlines()[0].startswith("strategy: ring (")
    for name in ("ring", "all_gather", "ulysses"):
        assert f"    {name}: " in text
    assert "    ring: chosen; sends 64.0 MiB, holds 40.0 MiB" in text
    assert "    all_gather: can run; sends 64.0 MiB, holds 96.0 MiB" in text
    assert "size=3 layout=zigzag query_length=24576" in text
    assert "mask=causal(bottom_right)" in text


def test_bad_arguments_name_themselves():
    q, k, v = _shards(64, 2, 2, 2)
    with pytest.raises(ValueError, match="size=0"):
        distributed.explain(q, k, v, size=0)
    with pytest.raises(ValueError, match=r"layout=.*'diagonal'"):
        distributed.explain(q, k, v, size=2, layout="diagonal")
    with pytest.raises(ValueError, match=r"query.shape\[-2\]=32 .*query_length=100"):
        distributed.explain(q, k, v, size=2, query_length=100)
    with pytest.raises(ValueError, match=r"strategy=.*'Auto'"):
        distributed.run_local(lambda g: distributed.attention(q, k, v, group=g,
                                                              strategy="Auto"), 2)
    with pytest.raises(ValueError, match=r"strategy=.*'best'"):
        distributed.gradients(None, None, q, k, v, None, None, None, strategy="best")


def test_explicit_ulysses_refuses_a_mask_with_a_head_axis():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 8, 4)) for _ in range(3))
    mask = rng.random((2, 8, 8)) < 0.7
    with pytest.raises(ValueError, match=r"ulysses.*varies by head"):
        distributed.run_local(lambda g: distributed.attention(
            *(distributed.shard(x, g) for x in (q, k, v)), group=g, mask=mask,
            strategy="ulysses"), 2)


def test_explicit_ulysses_refuses_a_function_mask():
    """Each rank attends for some of the heads: a function reading the head index
    would see that rank's own numbering."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 8, 4)) for _ in range(3))
    mask = masks.function(lambda b, h, q, k: (q >= k) | (h == 1))
    with pytest.raises(ValueError, match=r"ulysses.*function mask.*'ring'"):
        distributed.run_local(lambda g: distributed.attention(
            *(distributed.shard(x, g) for x in (q, k, v)), group=g, mask=mask,
            strategy="ulysses"), 2)


def _run(q, k, v, size, mask, strategy):
    lq = q.shape[-2]

    def rank_work(group):
        shards = [distributed.shard(x, group, layout="zigzag") for x in (q, k, v)]
        out = distributed.attention(*shards, group=group, mask=mask, layout="zigzag",
                                    strategy=strategy, query_length=lq, key_length=lq)
        return distributed.unshard(out, group, length=lq, layout="zigzag")

    return distributed.run_local(rank_work, size)[0]


@pytest.mark.parametrize(("hq", "hkv", "size", "budget", "expected"), [
    (4, 4, 3, 16 * 2**20, "all_gather"),  # small: under the byte budget
    (4, 1, 4, 0, "all_gather"),  # few K/V heads
    (4, 4, 4, 0, "ulysses"),
    (4, 4, 3, 0, "ring"),  # heads do not divide
])
def test_auto_runs_what_it_chose(monkeypatch, hq, hkv, size, budget, expected):
    monkeypatch.setattr(_choice, "ALL_GATHER_BYTES", budget)
    ran = []
    forward = _api.forward

    def spy(group, prob, query, key, value, strategy):
        ran.append(strategy)
        return forward(group, prob, query, key, value, strategy)

    monkeypatch.setattr(_api, "forward", spy)
    rng = np.random.default_rng(0)
    length = 14
    q = rng.standard_normal((2, hq, length, 8))
    k, v = (rng.standard_normal((2, hkv, length, 8)) for _ in range(2))
    mask = masks.causal()
    shards = (distributed.shard(x, (0, size), layout="zigzag") for x in (q, k, v))
    assert distributed.explain(*shards, size=size, mask=mask, layout="zigzag",
                               query_length=length, key_length=length).strategy == expected
    out = _run(q, k, v, size, mask, "auto")
    assert ran == [expected] * size  # every rank chose the same
    np.testing.assert_allclose(out, _run(q, k, v, size, mask, expected), rtol=1e-13,
                               atol=1e-14)
    want = portattn.attention(q, k, v, mask=mask, kernel="reference")
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_engines_only_see_a_concrete_strategy(monkeypatch):
    seen = []

    class Engine:  # what an engine plugin provides (torch.distributed, a JAX mesh axis)
        @staticmethod
        def rank_and_size(group):
            return None, 4  # a rank only known on the device, as inside shard_map

        @staticmethod
        def attention(prob, query, key, value, group, strategy):
            seen.append(strategy)
            return np.zeros(query.shape[:-1] + value.shape[-1:]), np.zeros(query.shape[:-1])

    monkeypatch.setitem(_wiring._parts, "numpy", _wiring.LibraryParts(distributed=Engine))
    q = np.zeros((1, 4, 8, 16))
    kv = np.zeros((1, 2, 8, 16))
    for strategy in ("auto", "ring", "all_gather"):
        distributed.attention(q, kv, kv, group="axis", strategy=strategy)
    assert seen == ["all_gather", "ring", "all_gather"]


@pytest.mark.parametrize("budget", [0, 16 * 2**20])  # auto: ulysses, then all_gather
def test_gradients_resolve_auto(monkeypatch, budget):
    monkeypatch.setattr(_choice, "ALL_GATHER_BYTES", budget)
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((1, 4, 12, 8)) for _ in range(4))
    mask = masks.causal()

    def grads(strategy):
        def rank_work(group):
            shards = [distributed.shard(x, group) for x in (q, k, v)]
            prob = distributed.problem(*shards, rank=group.rank, size=group.size, mask=mask)
            out, lse = distributed.attention(*shards, group=group, mask=mask,
                                             return_lse=True)
            got = distributed.gradients(group, prob, *shards, out, lse,
                                        distributed.shard(dout, group), strategy=strategy)
            return [distributed.unshard(g, group, length=12) for g in got]

        return distributed.run_local(rank_work, 4)[0]

    for got, want in zip(grads("auto"), grads("ring"), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
