"""When dispatch takes torch_flex over torch_sdpa and tiled, and how often flex compiles.

The rule (torch_flex's docstring): above ``min_scores`` scores, masks that
hide tiles SDPA would compute go to torch_flex; no mask, plain causal masks and dense
masks stay with SDPA; small calls stay with SDPA or tiled. It follows from the call's
description alone: asking compiles nothing."""

from __future__ import annotations

import numpy as np
import pytest
from flexcases import AnyCallOnCPU

from portattn.testing.plugin import require_library

torch = require_library("torch")

from portattn_torch import TorchFlexKernel, _flex_compile  # noqa: E402

import portattn  # noqa: E402
from portattn import masks  # noqa: E402
from portattn.kernel import describe  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LONG = 1024  # 4 heads x 1024 x 1024 scores: above the CPU's threshold


@pytest.fixture(autouse=True)
def _without_segments_and_windows():
    """On the CPU packed documents go to torch_sdpa_segments (test_torch_segments.py)
    and windows with global tokens to torch_sdpa_local (test_torch_local.py); these
    tests are about torch_flex's rules against torch_sdpa and tiled."""
    with portattn.disable_kernels("torch_sdpa_segments", "torch_sdpa_local"):
        yield


def _qkv(length=LONG, grad=False, dtype=torch.float32):
    return tuple(torch.zeros(1, 4, length, 64, dtype=dtype, requires_grad=grad)
                 for _ in range(3))


def _documents(length=LONG):
    ids = torch.from_numpy(np.repeat(np.arange(4), length // 4))
    return masks.causal() & masks.documents(ids)


TAKEN = {
    "documents": lambda: {"mask": _documents()},
    "window": lambda: {"mask": masks.sliding_window(128)},
    "global_tokens_or_window": lambda: {"mask": masks.sliding_window(64) | masks.global_tokens(
        torch.tensor([0, 500]))},
    "chunks": lambda: {"mask": masks.causal() & masks.chunks(256)},
    "block_layout": lambda: {"mask": masks.block_layout(torch.eye(8, dtype=torch.bool), 128)},
    "mask_function": lambda: {"mask": masks.function(lambda b, h, q, k: q // 64 == k // 64)},
    "padding": lambda: {"mask": masks.causal() & masks.key_lengths(torch.tensor([700]))},
    "softcap_without_mask": lambda: {"softcap": 30.0},
    "alibi_without_mask": lambda: {"alibi_slopes": torch.full((4,), 0.1)},
}


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_long_calls_with_sparse_masks_run_torch_flex(name):
    before = _flex_compile.compilations()
    plan = portattn.explain(*_qkv(), **TAKEN[name]())
    assert plan.kernel.name == "torch_flex", str(plan)
    assert _flex_compile.compilations() == before  # choosing compiles nothing
    assert "note: compiles flex_attention on the first call of each kind" in str(plan)
    per_length = "on the CPU, with documents, it compiles again for each new length"
    assert (per_length in plan.kernel_notes) == (name == "documents")


LEFT = {
    "no_mask": ({}, "torch_sdpa", "no mask: SDPA runs it as it is"),
    "causal": ({"mask": masks.causal()}, "torch_sdpa", "SDPA runs it without a mask tensor"),
    "dense": ({"mask": masks.dense(torch.ones(LONG, LONG, dtype=torch.bool))}, "torch_sdpa",
              "dense mask (SDPA reads it as it is)"),
    "short_documents": ({"mask": _documents(256)}, "torch_sdpa", "262144 scores < 2097152"),
    "short_softcap": ({"softcap": 30.0}, "tiled", "262144 scores < 2097152 on cpu"),
    "gradients_on_cpu": ({"mask": _documents()}, "torch_sdpa", "gradients on cpu"),
    "lse_on_cpu": ({"mask": _documents(), "return_lse": True}, "tiled", "return_lse on cpu"),
    "float64": ({"mask": _documents()}, "torch_sdpa", "dtype=float64"),
}


@pytest.mark.parametrize("name", sorted(LEFT))
def test_what_other_kernels_run_better_is_left_to_them(name):
    kwargs, kernel, reason = LEFT[name]
    length = 256 if name.startswith("short") else LONG
    dtype = torch.float64 if name == "float64" else torch.float32
    plan = portattn.explain(*_qkv(length, grad=name == "gradients_on_cpu", dtype=dtype),
                            **kwargs)
    assert plan.kernel.name == kernel, str(plan)
    why = "; ".join(dict((e.name, r) for e, r in plan.candidates)["torch_flex"])
    assert reason in why


def test_the_threshold_is_data_on_the_kernel():
    inputs = describe(*_qkv(256), mask=_documents(256))
    assert TorchFlexKernel.dispatch_reasons(inputs)
    assert not AnyCallOnCPU.dispatch_reasons(inputs)


# --- compiling once ----------------------------------------------------------------

def _run(q_len, mask, kernel=AnyCallOnCPU, **kwargs):
    g = torch.Generator().manual_seed(q_len)
    q, k, v = (torch.randn(1, 2, q_len, 16, generator=g) for _ in range(3))
    out, _, _ = kernel().run(describe(q, k, v, mask=mask(q_len), **kwargs))
    want = portattn.attention(q.double(), k.double(), v.double(), mask=mask(q_len),
                              kernel="reference", **kwargs)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_a_kind_of_call_compiles_once_for_every_length():
    def window(length):  # a new mask object each call
        return masks.causal() & masks.sliding_window(24)

    before = _flex_compile.compilations()
    _run(80, window)
    first = _flex_compile.compilations()
    assert first == before + 1
    for length in (96, 200, 333):
        _run(length, window)
    assert _flex_compile.compilations() == first


def test_a_kind_first_met_with_equal_lengths_serves_unequal_ones():
    # a prefill (Lq == Lk), then chunks of one against a longer cache
    def call(q_len, k_len):
        g = torch.Generator().manual_seed(q_len + k_len)
        q = torch.randn(2, 2, q_len, 16, generator=g)
        k, v = (torch.randn(2, 2, k_len, 16, generator=g) for _ in range(2))
        out, _, _ = AnyCallOnCPU().run(describe(q, k, v, mask=masks.causal("bottom_right")))
        want = portattn.attention(q.double(), k.double(), v.double(), kernel="reference",
                                  mask=masks.causal("bottom_right"))
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)

    before = _flex_compile.compilations()
    call(48, 48)
    assert _flex_compile.compilations() == before + 1
    for q_len, k_len in ((32, 64), (40, 104), (100, 100)):
        call(q_len, k_len)
    assert _flex_compile.compilations() == before + 1


def test_a_new_closure_of_the_same_mask_function_compiles_nothing_new():
    def strided(length):
        step = 3

        return masks.function(lambda b, h, q, k: (q >= k) & ((q - k) % step == 0))

    _run(70, strided)
    compiled = _flex_compile.compilations()
    _run(70, strided)
    _run(110, strided)
    assert _flex_compile.compilations() == compiled


def test_on_the_cpu_a_mask_holding_length_sized_arrays_compiles_once_per_length():
    # torch's CPU template needs those arrays static (see _flex_mods)
    def documents(length):
        return masks.documents(torch.arange(length) // 20)

    before = _flex_compile.compilations()
    _run(90, documents)
    _run(90, documents)
    assert _flex_compile.compilations() == before + 1
    _run(120, documents)
    assert _flex_compile.compilations() == before + 2


def test_a_mask_int_never_reaches_flex_as_a_symbol(monkeypatch):
    # Off the CPU the tensors the mask reads are not static. A window's int made dynamic
    # there failed inductor's lowering (torch 2.11, CUDA); ints are specialised, and a
    # kind still compiles once for every length.
    from portattn_torch import _flex_kernel

    as_on_a_device = _flex_kernel.block_mask_of
    monkeypatch.setattr(_flex_kernel, "block_mask_of",
                        lambda inputs, block, static: as_on_a_device(inputs, block, False))

    def window(length):
        return masks.sequence_window(6, 0, query_lengths=torch.tensor([length]),
                                     key_lengths=torch.tensor([length - 5]))

    before = _flex_compile.compilations()
    _run(70, window)
    assert _flex_compile.compilations() == before + 1
    for length in (90, 130):
        _run(length, window)
    assert _flex_compile.compilations() == before + 1
