"""``triton_flash``'s paged decode in the interpreter: dispatch gives it torch's paged
decode steps, it answers as the portable loop does (bands, GQA, ALiBi, softcap, sinks,
both layouts, several splits), a value it may not read never reaches a result, and
what it refuses is named."""

from __future__ import annotations

import numpy as np
import pytest

from portattn.testing.paged import scattered_pages
from portattn.testing.plugin import require_library

torch = require_library("torch")
pytest.importorskip("triton")

from portattn_triton import TritonFlashKernel  # noqa: E402
from portattn_triton._launch_paged import paged_forward  # noqa: E402

import portattn  # noqa: E402
from portattn import masks  # noqa: E402

HQ, HKV, D, DV = 4, 2, 16, 32

#: Decodes, a short speculative run, a sequence with no query, one key only.
SEQUENCES = [(1, 70), (3, 21), (0, 9), (1, 1), (2, 40)]


def _call(sequences, page, layout="blhd", garbage=0.0, dtype=torch.float32, seed=0):
    rng = np.random.default_rng(seed)
    k_pool, v_pool, table, _ = scattered_pages(rng, [n for _, n in sequences], page, HKV, D,
                                               DV, layout=layout, garbage=garbage)
    starts = np.cumsum([0] + [q for q, _ in sequences])
    query = rng.standard_normal((starts[-1], HQ, D))
    arrays = tuple(torch.tensor(np.ascontiguousarray(a), dtype=dtype)
                   for a in (query, k_pool, v_pool))
    return arrays, {"block_table": torch.tensor(table),
                    "key_lengths": torch.tensor([n for _, n in sequences]),
                    "query_starts": torch.tensor(starts), "layout": layout}


def _portable(arrays, options):
    with portattn.disable_kernels("triton_flash"):
        return portattn.paged_attention(*arrays, **options)


def test_dispatch_gives_torch_decode_steps_to_triton_flash():
    arrays, options = _call(SEQUENCES, 8)
    plan = portattn.explain_paged(*arrays, **options, mask=masks.causal())
    assert plan.kernel.name == "triton_flash"


@pytest.mark.parametrize(("page", "layout", "mask"), [
    (8, "blhd", masks.causal()), (1, "bhld", masks.causal() & masks.sliding_window(6)),
    (16, "bhld", None), (64, "blhd", masks.sliding_window(5, 2))])
def test_agrees_with_the_portable_loop(page, layout, mask):
    arrays, options = _call(SEQUENCES, page, layout)
    options.update(mask=mask, return_lse=True)
    out, lse = portattn.paged_attention(*arrays, **options)
    want, want_lse = _portable(arrays, options)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, want_lse, rtol=2e-5, atol=2e-5)


def test_scores_options_agree_with_the_portable_loop():
    arrays, options = _call(SEQUENCES, 8, seed=1)
    gen = torch.Generator().manual_seed(2)
    options.update(mask=masks.causal(), softcap=2.0, scale=0.4, return_lse=True,
                   alibi_slopes=torch.rand((len(SEQUENCES), HQ), generator=gen) * 0.3,
                   sinks=torch.randn(HQ, generator=gen))
    out, lse = portattn.paged_attention(*arrays, **options)
    want, want_lse = _portable(arrays, options)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, want_lse, rtol=2e-5, atol=2e-5)


def test_several_splits_and_half_precision():
    from portattn.paged import _checked

    arrays, options = _call([(1, 300), (2, 130)], 16, dtype=torch.float16, seed=3)
    call = _checked(*arrays, options["block_table"], options["key_lengths"],
                    options["query_starts"], masks.causal(), None, None, None, None, "blhd")
    out, lse = paged_forward(call, num_splits=3)
    want, want_lse = _portable(arrays, {**options, "mask": masks.causal(),
                                        "return_lse": True})
    torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse, want_lse, rtol=2e-3, atol=2e-3)


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


def test_what_it_refuses_is_named():
    from portattn.paged import _checked

    arrays, options = _call([(40, 40)], 8)
    call = _checked(*arrays, options["block_table"], options["key_lengths"],
                    options["query_starts"], masks.causal() & masks.chunks(8), None, None,
                    None, None, "blhd")
    reasons = " ".join(TritonFlashKernel.paged_reasons(call))
    assert "is not made of causal and window parts" in reasons
    assert "2 query heads per K/V head x 40 queries of one sequence > " in reasons
    plan = portattn.explain_paged(*arrays, **options, mask=masks.causal())
    assert plan.kernel is None or plan.kernel.name != "triton_flash"
