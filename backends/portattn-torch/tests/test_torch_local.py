"""torch_sdpa_local against the float64 reference: the conformance kit, windows joined
to global tokens (edges, repeats, unused positions, per batch element, cross
attention, grouped-query heads, value head dims, half precision), dispatch, and the
rule for non-finite inputs."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
from portattn_torch import TorchLocalKernel

from portattn.testing import check_case, conformance_cases
from portattn.testing.plugin import require_library

torch = require_library("torch")

import portattn  # noqa: E402
from portattn import masks  # noqa: E402
from portattn.kernel import AttentionInputs, describe  # noqa: E402

NAME = "torch_sdpa_local"


class AnyCall(TorchLocalKernel):
    """The kernel taking masks without global tokens too, so that the kit's cases
    reach it."""

    needs_global_tokens: ClassVar[bool] = False


def _torch_cpu(backend):
    if backend.namespace != "torch" or backend.device_kind != "cpu":
        pytest.skip(f"{NAME} runs on torch's CPU only")


@pytest.mark.parametrize("case", conformance_cases(AnyCall), ids=str)
def test_conformance(case, backend):
    check_case(AnyCall, case, backend)


CALLS = {
    # name: (batch, hq, hkv, lq, lk, d, dv), band, positions
    "window": ((2, 4, 4, 700, 700, 16, 16), (64, 0), [0, 333, 699]),
    "window_both_sides_repeats_unused": ((2, 4, 4, 700, 700, 16, 16), (64, 5),
                                         [0, 333, -1, 333]),
    "short_queries": ((2, 4, 4, 300, 700, 16, 16), (64, 0), [0, 650, 2]),
    "long_queries": ((2, 4, 4, 700, 300, 16, 16), (64, 0), [0, 250]),
    "per_batch_positions": ((2, 4, 4, 700, 700, 16, 16), (64, 0), [[1, 500], [3, -1]]),
    "grouped_query_value_head_dim": ((2, 6, 2, 700, 700, 32, 8), (64, 0), [10, 20]),
    "value_head_dim_wider": ((1, 2, 2, 300, 300, 8, 24), (20, 3), [150]),
    "causal": ((2, 4, 4, 600, 600, 16, 16), None, [10, 20]),
    "narrow_window_many_chunks": ((1, 2, 2, 1000, 1000, 16, 16), (3, 0), [999, 0, 512]),
    "no_batch_dims": (((), 2, 2, 200, 200, 16, 16), (16, 16), [100]),
}


def _inputs(shapes, dtype, seed=0):
    batch, hq, hkv, lq, lk, d, dv = shapes
    batch = batch if isinstance(batch, tuple) else (batch,)
    g = torch.Generator().manual_seed(seed)
    sizes = ((*batch, hq, lq, d), (*batch, hkv, lk, d), (*batch, hkv, lk, dv))
    return [torch.randn(s, generator=g).to(dtype) for s in sizes]


def _mask(band, positions):
    local = masks.causal() if band is None else masks.sliding_window(*band)
    return local | masks.global_tokens(torch.tensor(positions))


TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-9, torch.float16: 5e-3,
             torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(CALLS))
def test_forward_and_lse_against_the_reference(name, dtype, backend):
    _torch_cpu(backend)
    shapes, band, positions = CALLS[name]
    q, k, v = _inputs(shapes, dtype)
    mask = _mask(band, positions)
    out, lse = portattn.attention(q, k, v, mask=mask, return_lse=True, kernel=NAME)
    want, want_lse = portattn.attention(q.double(), k.double(), v.double(), mask=mask,
                                        return_lse=True, kernel="reference")
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype
    assert lse.dtype == (torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)


def test_dispatch_chooses_it_for_a_window_with_global_tokens():
    q = torch.zeros(1, 8, 4096, 64)
    mask = masks.sliding_window(512) | masks.global_tokens(torch.arange(16) * 256)
    assert portattn.explain(q, q, q, mask=mask).kernel.name == NAME
    plan = portattn.explain(q, q, q, mask=masks.sliding_window(512))
    assert plan.kernel.name != NAME
    why = dict((e.name, w) for e, w in plan.candidates)[NAME]
    assert any("no global_tokens" in w for w in why), why
    grad = q.clone().requires_grad_(True)
    assert portattn.explain(grad, grad, grad, mask=mask).kernel.name != NAME


@pytest.mark.parametrize(("lq", "lk"), [(64, 64), (40, 64), (64, 40)])
def test_an_intersection_of_bands_is_one_band(lq, lk, backend):
    # top-left causal & a bottom-right window leave no pair when lq < lk - 8: the
    # global tokens alone remain
    _torch_cpu(backend)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, lq, 16, generator=g)
    k, v = (torch.randn(1, 2, lk, 16, generator=g) for _ in range(2))
    mask = ((masks.causal(alignment="top_left") & masks.sliding_window(6, 2))
            | masks.global_tokens(torch.tensor([3, 20])))
    out = portattn.attention(q, k, v, mask=mask, kernel=NAME)
    want = portattn.attention(q.double(), k.double(), v.double(), mask=mask,
                              kernel="reference")
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mask", [
    masks.sliding_window(4) | masks.sink_tokens(2),
    masks.sliding_window(4) | masks.causal() | masks.global_tokens(torch.tensor([3])),
], ids=["sink_tokens", "two_bands"])
def test_other_structures_are_refused(mask):
    q = torch.zeros(1, 2, 64, 16)
    why = TorchLocalKernel.not_supported_reasons(describe(q, q, q, mask=mask))
    assert why


def test_calls_whose_values_cannot_be_read_are_refused(monkeypatch):
    q = torch.zeros(1, 2, 64, 16)
    mask = masks.sliding_window(8) | masks.global_tokens(torch.tensor([3]))
    monkeypatch.setattr(AttentionInputs, "values_readable", property(lambda self: False))
    why = TorchLocalKernel.not_supported_reasons(describe(q, q, q, mask=mask))
    assert any("values not readable" in w for w in why), why


def test_a_nan_hidden_by_the_window_gives_the_clean_answer(backend):
    # the window's chunks compute keys outside some rows' windows with weight 0:
    # dispatch checks the output and runs another kernel for the call
    _torch_cpu(backend)
    shapes, band, positions = CALLS["window"]
    q, k, v = _inputs(shapes, torch.float32)
    mask = _mask(band, positions)
    clean = portattn.attention(q, k, v, mask=mask)
    v[:, :, 400] = math.nan
    out = portattn.attention(q, k, v, mask=mask)
    seen = torch.zeros(700, dtype=torch.bool)
    seen[400:465] = True  # the rows whose window holds key 400
    seen[[0, 333, 699]] = True  # the global rows see every key
    assert torch.isnan(out[:, :, seen]).all()
    torch.testing.assert_close(out[:, :, ~seen], clean[:, :, ~seen])
