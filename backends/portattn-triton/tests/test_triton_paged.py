"""``triton_flash``'s paged attention in the interpreter: dispatch gives it torch's paged
calls, decode steps and prefills alike; it answers as the portable loop does (bands,
GQA, ALiBi, softcap, sinks, both layouts, page sizes, tiles cut into several splits,
groups taller than a tile), a value it may not read never reaches a result, and what
it refuses is named. The host plan of tiles and splits is checked on its own."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from portattn.testing.paged import scattered_pages
from portattn.testing.plugin import require_library

torch = require_library("torch")
pytest.importorskip("triton")

from portattn_triton import TritonFlashKernel  # noqa: E402
from portattn_triton._launch_paged import paged_forward  # noqa: E402
from portattn_triton._paged_tiles import plan_tiles  # noqa: E402

import portattn  # noqa: E402
from portattn import masks  # noqa: E402
from portattn.paged import _checked  # noqa: E402

HQ, HKV, D, DV = 4, 2, 16, 32

#: (queries, keys) per sequence. Decodes, a short speculative run, a sequence with no
#: query, one key only.
SEQUENCES = [(1, 70), (3, 21), (0, 9), (1, 1), (2, 40)]
#: Prefill chunks beside decodes: no query, one, a few, a whole prompt, a prompt's end.
MIXED = [(0, 9), (1, 70), (5, 21), (40, 40), (100, 130)]


def _call(sequences, page, layout="blhd", garbage=0.0, dtype=torch.float32, seed=0,
          heads=(HQ, HKV)):
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    k_pool, v_pool, table, _ = scattered_pages(rng, [n for _, n in sequences], page, hkv, D,
                                               DV, layout=layout, garbage=garbage)
    starts = np.cumsum([0] + [q for q, _ in sequences])
    query = rng.standard_normal((starts[-1], hq, D))
    arrays = tuple(torch.tensor(np.ascontiguousarray(a), dtype=dtype)
                   for a in (query, k_pool, v_pool))
    return arrays, {"block_table": torch.tensor(table),
                    "key_lengths": torch.tensor([n for _, n in sequences]),
                    "query_starts": torch.tensor(starts), "layout": layout}


def _portable(arrays, options):
    with portattn.disable_kernels("triton_flash"):
        return portattn.paged_attention(*arrays, **options)


def _described(arrays, options, mask=None, **scores):
    """The checked description of a call (what ``run_paged`` receives)."""
    return _checked(*arrays, options["block_table"], options["key_lengths"],
                    options["query_starts"], mask, scores.get("scale"),
                    scores.get("softcap"), scores.get("alibi_slopes"), scores.get("sinks"),
                    options["layout"])


def _agree(got, want, tol=2e-5):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("sequences", [SEQUENCES, MIXED], ids=["decode", "prefill"])
def test_dispatch_gives_torch_paged_calls_to_triton_flash(sequences):
    arrays, options = _call(sequences, 8, heads=(8, 2))
    plan = portattn.explain_paged(*arrays, **options, mask=masks.causal())
    assert plan.kernel.name == "triton_flash"


@pytest.mark.parametrize(("page", "layout", "mask"), [
    (8, "blhd", masks.causal()), (1, "bhld", masks.causal() & masks.sliding_window(6)),
    (16, "bhld", None), (64, "blhd", masks.sliding_window(5, 2))])
def test_decode_agrees_with_the_portable_loop(page, layout, mask):
    arrays, options = _call(SEQUENCES, page, layout)
    options.update(mask=mask, return_lse=True)
    _agree(portattn.paged_attention(*arrays, **options), _portable(arrays, options))


@pytest.mark.parametrize(("page", "layout", "mask", "heads"), [
    (16, "blhd", masks.causal(), (8, 2)),
    (1, "bhld", masks.causal() & masks.sliding_window(12), (8, 2)),
    (64, "bhld", None, (4, 4)),
    (16, "blhd", masks.sliding_window(9, 3), (6, 1))])
def test_prefill_agrees_with_the_portable_loop(page, layout, mask, heads):
    arrays, options = _call(MIXED, page, layout, heads=heads)
    options.update(mask=mask, return_lse=True)
    _agree(portattn.paged_attention(*arrays, **options), _portable(arrays, options))


@pytest.mark.parametrize("sequences", [SEQUENCES, MIXED], ids=["decode", "prefill"])
def test_scores_options_agree_with_the_portable_loop(sequences):
    arrays, options = _call(sequences, 8, seed=1)
    gen = torch.Generator().manual_seed(2)
    options.update(mask=masks.causal(), softcap=2.0, scale=0.4, return_lse=True,
                   alibi_slopes=torch.rand((len(sequences), HQ), generator=gen) * 0.3,
                   sinks=torch.randn(HQ, generator=gen))
    _agree(portattn.paged_attention(*arrays, **options), _portable(arrays, options))


def test_several_splits_and_half_precision():
    arrays, options = _call([(1, 300), (2, 130)], 16, dtype=torch.float16, seed=3)
    call = _described(arrays, options, masks.causal())
    want = _portable(arrays, {**options, "mask": masks.causal(), "return_lse": True})
    _agree(paged_forward(call, num_splits=3), want, tol=2e-3)


def test_prefill_tiles_in_several_splits_with_sinks():
    """Short tiles of a prefill and a decode, each cut into splits whose merge joins
    the sinks; every packed row lands where it belongs."""
    arrays, options = _call([(30, 200), (1, 150), (0, 5)], 16, dtype=torch.float16, seed=5)
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(6))
    mask = masks.causal() & masks.sliding_window(90)
    call = _described(arrays, options, mask, sinks=sinks)
    want = _portable(arrays, {**options, "mask": mask, "sinks": sinks, "return_lse": True})
    _agree(paged_forward(call, num_splits=3, block_m=16), want, tol=2e-3)


def test_groups_taller_than_a_tile():
    """20 query heads per K/V head in tiles of 16 rows: each query's heads span two
    tiles."""
    arrays, options = _call([(2, 30), (1, 17)], 8, seed=7, heads=(40, 2))
    call = _described(arrays, options, masks.causal())
    want = _portable(arrays, {**options, "mask": masks.causal(), "return_lse": True})
    _agree(paged_forward(call, block_m=16), want)


def test_values_it_may_not_read_never_reach_a_result():
    arrays, options = _call(SEQUENCES, 8, garbage=np.nan, seed=4)
    query, k_pool, v_pool = arrays
    table = options["block_table"]
    v_pool[table[0, 8], 5] = float("inf")  # key 69 of sequence 0, the last it sees
    v_pool[table[4, 0], 0, 0, 0] = float("nan")  # key 0 of sequence 4
    options.update(mask=masks.causal() & masks.sliding_window(8))
    out = portattn.paged_attention(query, k_pool, v_pool, **options)
    want = _portable((query, k_pool, v_pool), options)
    assert torch.equal(out.isnan(), want.isnan())
    assert out[0].isnan().all()  # sequence 0's query sees key 69
    assert not out[1:].isnan().any()  # sequence 4's window ends past key 0
    torch.testing.assert_close(out[1:], want[1:], rtol=2e-5, atol=2e-5)


def test_a_prefill_is_poisoned_only_where_its_queries_see_the_value():
    arrays, options = _call([(40, 40), (5, 21)], 16, layout="bhld", garbage=np.inf, seed=8)
    query, k_pool, v_pool = arrays
    v_pool[options["block_table"][0, 1], 0, 4, 3] = float("nan")  # key 20, K/V head 0
    options.update(mask=masks.causal() & masks.sliding_window(10))
    out = portattn.paged_attention(query, k_pool, v_pool, **options)
    want = _portable((query, k_pool, v_pool), options)
    seen = out[:40].isnan().any(-1)  # (queries, heads)
    assert torch.equal(out.isnan(), want.isnan())
    assert seen[20:31, :2].all()  # queries 20 to 30 see key 20 in their window
    assert not seen[:20].any()
    assert not seen[31:].any()
    assert not seen[:, 2:].any()  # the other K/V head's queries
    keep = ~want.isnan()
    torch.testing.assert_close(out[keep], want[keep], rtol=2e-5, atol=2e-5)


def test_what_it_refuses_is_named():
    arrays, options = _call([(40, 40)], 8)
    call = _described(arrays, options, masks.causal() & masks.chunks(8))
    reasons = " ".join(TritonFlashKernel.paged_reasons(call))
    assert "is not made of causal and window parts" in reasons
    plan = portattn.explain_paged(*arrays, **options, mask=masks.causal() & masks.chunks(8))
    assert plan.kernel is None or plan.kernel.name != "triton_flash"
    query, pool = torch.zeros((2, 4, 256)), torch.zeros((2, 4, 2, 256))
    call = _checked(query, pool, pool, torch.tensor([[0, 1]]), torch.tensor([8]),
                    torch.tensor([0, 2]), None, None, None, None, None, "blhd")
    assert TritonFlashKernel.paged_reasons(call) == [
        "dtype=float32 with head dims (256, 256) (no paged tile without register spills)"]


# --- the host plan -------------------------------------------------------------------

@pytest.mark.parametrize(("band", "group", "block_m", "num_splits"), [
    ((None, 0), 4, 64, None), ((-7, 0), 3, 16, 3), ((None, None), 20, 16, 2),
    ((-5, 2), 1, 32, 4)])
def test_the_plan_covers_each_query_and_its_keys_once(band, group, block_m, num_splits):
    starts, lengths = np.cumsum([0] + [q for q, _ in MIXED]), [n for _, n in MIXED]
    plan = plan_tiles(list(starts), lengths, group, block_m, 16, band, 2, None, num_splits)
    assert plan.tile_heads * plan.tile_queries <= block_m
    lower, upper = band
    tiles = {}  # (first query, first head) -> (queries, [(lo, hi, part)] of its splits)
    for seq, row, count, position, head, lo, hi, part in plan.items.tolist():
        n = starts[seq + 1] - starts[seq]
        assert starts[seq] <= row
        assert row + count <= starts[seq + 1]
        assert position == lengths[seq] - n + row - starts[seq]
        assert 0 <= lo <= hi <= lengths[seq]
        assert lower is None or lo >= max(position + lower, 0) or lo == hi
        assert upper is None or hi <= position + count + upper
        tiles.setdefault((row, head), (count, []))[1].append((lo, hi, part))
    heads_of = {}  # packed query -> first heads of the tiles holding it
    for (row, head), (count, splits) in tiles.items():
        splits.sort()
        assert all(a[1] == b[0] for a, b in pairwise(splits))  # every key once
        assert (len(splits) == 1) == (splits[0][2] == -1)  # one split: no merge
        for r in range(row, row + count):
            heads_of.setdefault(r, []).append(head)
    assert sorted(heads_of) == list(range(starts[-1]))
    assert all(len(h) == -(-group // plan.tile_heads) for h in heads_of.values())
    assert plan.merges[:, 5].sum() == plan.parts == (plan.items[:, 7] >= 0).sum()
