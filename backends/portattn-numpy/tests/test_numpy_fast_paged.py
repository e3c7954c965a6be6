"""Which paged calls numpy_fast takes (causal and window masks, with Numba), that
dispatch gives them to it, and that it answers as the portable loop does."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_numpy import NumpyFastKernel

import portattn
from portattn import masks
from portattn.kernel import Kernel
from portattn.paged import _checked

pytest.importorskip("numba", reason="the compiled paged loop needs Numba (portattn-numpy[jit])")


CAUSAL = masks.causal()


def _decode(queries_per_sequence, mask=CAUSAL, seed=0):
    """A paged call's arguments: 5 sequences of 1 to 90 keys in pages of 4, scattered
    over a pool of 64."""
    rng = np.random.default_rng(seed)
    lengths = np.array([90, 17, 1, 40, 64])
    table = np.full((5, 23), -1, dtype=np.int32)
    free = iter(rng.permutation(64))
    for s, n in enumerate(lengths):
        table[s, :-(-n // 4)] = [next(free) for _ in range(-(-n // 4))]
    pool = rng.standard_normal((64, 4, 2, 16)).astype(np.float32)
    values = rng.standard_normal((64, 4, 2, 8)).astype(np.float32)
    counts = [min(queries_per_sequence, n) for n in lengths]
    starts = np.cumsum([0, *counts])
    q = rng.standard_normal((starts[-1], 4, 16)).astype(np.float32)
    return (q, pool, values), {"block_table": table, "key_lengths": lengths,
                               "query_starts": starts, "mask": mask}


def _described(arrays, options):
    return _checked(*arrays, options["block_table"], options["key_lengths"],
                    options["query_starts"], options["mask"], None, None, None, None, "blhd")


@pytest.mark.parametrize("mask", [None, masks.causal(), masks.causal() & masks.sliding_window(7),
                                  masks.sliding_window(5, 3)], ids=["none", "causal", "window",
                                                                    "two_sided"])
def test_decode_steps_run_the_compiled_loop_and_agree(mask, monkeypatch):
    ran = []
    run = NumpyFastKernel.run_paged
    monkeypatch.setattr(NumpyFastKernel, "run_paged",
                        lambda self, call: ran.append(call) or run(self, call))
    arrays, options = _decode(2, mask)
    out, lse = portattn.paged_attention(*arrays, **options, softcap=4.0, return_lse=True,
                                        alibi_slopes=np.linspace(0.1, 0.4, 4, dtype=np.float32),
                                        sinks=np.zeros(4, np.float32))
    assert len(ran) == 1
    with portattn.disable_kernels("numpy_fast"):
        want, want_lse = portattn.paged_attention(
            *arrays, **options, softcap=4.0, return_lse=True,
            alibi_slopes=np.linspace(0.1, 0.4, 4, dtype=np.float32),
            sinks=np.zeros(4, np.float32))
    assert len(ran) == 1  # disabled: the portable loop ran
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)


def test_prompts_run_the_compiled_loop_too():
    assert NumpyFastKernel.paged_reasons(_described(*_decode(90))) == []


@pytest.mark.parametrize(("queries", "mask", "reason"), [
    (1, masks.causal() | masks.sink_tokens(2), "is not made of causal and window parts"),
    (1, masks.causal() & masks.chunks(8), "is not made of causal and window parts"),
])
def test_what_the_compiled_loop_leaves_to_the_portable_one(queries, mask, reason):
    reasons = NumpyFastKernel.paged_reasons(_described(*_decode(queries, mask)))
    assert any(reason in r for r in reasons), reasons


def test_a_kernel_takes_paged_calls_only_when_it_says_so():
    call = _described(*_decode(1))
    assert Kernel.paged_reasons(call) == ["paged calls not supported"]

    class TorchOnly(Kernel):
        name = "torch_only"
        namespaces = frozenset({"torch"})
        devices = frozenset({"cpu"})
        dtypes = frozenset({"float32"})
        paged = True

    assert TorchOnly.paged_reasons(call) == ["namespace=numpy (supported: torch)"]
    assert NumpyFastKernel.paged_reasons(call) == []


def test_paged_calls_from_several_threads_at_once():
    """A server may attend from several threads: the compiled loop runs on the
    package's thread pool, which takes calls from any thread."""
    from concurrent.futures import ThreadPoolExecutor

    calls = [_decode(2, seed=seed) for seed in range(4)]
    alone = [portattn.paged_attention(*arrays, **options) for arrays, options in calls]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda c: portattn.paged_attention(*c[0], **c[1]), calls))
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a, b)
