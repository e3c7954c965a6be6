"""torch_sdpa_segments against the float64 reference: the conformance kit, packed
documents forward and gradients (query, key, value and the log-sum-exp), the path
for ids that are not block diagonal, dispatch, and the rule for non-finite inputs."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest

from portattn.testing import check_case, conformance_cases
from portattn.testing.plugin import require_library

torch = require_library("torch")

from portattn_torch import TorchSegmentsKernel  # noqa: E402
from portattn_torch._segments import plan_of  # noqa: E402

import portattn  # noqa: E402
from portattn import masks  # noqa: E402
from portattn.kernel import AttentionInputs, describe  # noqa: E402

NAME = "torch_sdpa_segments"


class AnyCall(TorchSegmentsKernel):
    """The kernel taking calls without a documents mask too (one segment per batch
    element), so that the kit's cases reach it."""

    documents_only: ClassVar[bool] = False


def _torch_cpu(backend):
    if backend.namespace != "torch" or backend.device_kind != "cpu":
        pytest.skip(f"{NAME} runs on torch's CPU only")


@pytest.mark.parametrize("case", conformance_cases(AnyCall), ids=str)
def test_conformance(case, backend):
    check_case(AnyCall, case, backend)


def _ids(*lengths, pad=0):
    """Ids of consecutive documents of ``lengths``, then ``pad`` padding positions."""
    ids = [d for d, n in enumerate(lengths) for _ in range(n)]
    return torch.tensor(ids + [-1] * pad)


CALLS = {
    # name: (shapes (batch, hq, hkv, lq, lk, d, dv), mask builder)
    "documents": ((2, 4, 4, 70, 70, 16, 16),
                  lambda: masks.documents(_ids(20, 3, 30, 17))),
    "documents_causal": ((2, 4, 4, 70, 70, 16, 16),
                         lambda: masks.causal() & masks.documents(_ids(20, 3, 30, 17))),
    "documents_causal_top_left": ((1, 2, 2, 64, 64, 16, 16),
                                  lambda: masks.documents(_ids(40, 24)) & masks.causal("top_left")),
    "padding": ((2, 4, 4, 70, 70, 16, 16),
                lambda: masks.causal() & masks.documents(_ids(25, 30, pad=15))),
    "key_lengths": ((3, 4, 4, 70, 70, 16, 16),
                    lambda: masks.causal() & masks.documents(_ids(20, 30, 20))
                    & masks.key_lengths(torch.tensor([70, 45, 10]))),
    "key_lengths_empty_batch_element": ((2, 2, 2, 40, 40, 16, 16),
                                        lambda: masks.documents(_ids(20, 20))
                                        & masks.key_lengths(torch.tensor([0, 33]))),
    "query_lengths": ((2, 4, 4, 70, 70, 16, 16),
                      lambda: masks.causal() & masks.documents(_ids(20, 30, 20))
                      & masks.query_lengths(torch.tensor([50, 5]))),
    "grouped_query": ((2, 6, 2, 70, 70, 32, 32),
                      lambda: masks.causal() & masks.documents(_ids(20, 30, 20))),
    "multi_query": ((1, 4, 1, 50, 50, 16, 16),
                    lambda: masks.causal() & masks.documents(_ids(9, 41))),
    "per_batch_documents": ((3, 4, 4, 60, 60, 16, 16),
                            lambda: masks.causal() & masks.documents(torch.stack(
                                [_ids(10, 50), _ids(30, 29, pad=1), _ids(60)]))),
    "two_batch_dims": (((2, 2), 2, 2, 40, 40, 16, 16),
                       lambda: masks.causal() & masks.documents(torch.stack(
                           [_ids(10, 30), _ids(25, 15)]).reshape(2, 1, 40).expand(2, 2, 40)
                           .contiguous())),
    "value_head_dim_wider": ((2, 4, 4, 50, 50, 16, 24),
                             lambda: masks.causal() & masks.documents(_ids(20, 30))),
    "value_head_dim_narrower": ((2, 4, 4, 50, 50, 32, 8),
                                lambda: masks.causal() & masks.documents(_ids(20, 30))),
    # cross attention: separate key ids; document 1 has no keys, document 3 no queries
    "cross_documents": ((2, 4, 4, 40, 90, 16, 16),
                        lambda: masks.documents(_ids(10, 10, 20), torch.tensor(
                            [0] * 30 + [2] * 40 + [3] * 20))),
    "cross_documents_causal": ((2, 4, 4, 40, 90, 16, 16),
                               lambda: masks.causal() & masks.documents(
                                   _ids(10, 10, 20), torch.tensor([0] * 30 + [1] * 20
                                                                  + [2] * 40))),
    "decode_step": ((2, 4, 4, 1, 60, 16, 16),
                    lambda: masks.causal() & masks.documents(torch.tensor([1]),
                                                             _ids(30, 30))),
    "short_documents": ((2, 4, 4, 64, 64, 16, 16),
                        lambda: masks.causal() & masks.documents(_ids(*[4] * 16))),
}


def _inputs(shapes, dtype=torch.float32, seed=0):
    batch, hq, hkv, lq, lk, d, dv = shapes
    batch = batch if isinstance(batch, tuple) else (batch,)
    g = torch.Generator().manual_seed(seed)
    sizes = ((*batch, hq, lq, d), (*batch, hkv, lk, d), (*batch, hkv, lk, dv))
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(True) for s in sizes]


def _loss(out, lse, seed=1):
    """A loss through the output and the finite log-sum-exps, with random weights."""
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g).to(out.dtype)
    w_lse = torch.randn(lse.shape, generator=g).to(lse.dtype)
    finite = torch.isfinite(lse)
    return (out * w_out).sum() + torch.where(finite, lse * w_lse, 0.0).sum()


TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.float16: 1e-2,
             torch.bfloat16: 6e-2}


def _check(name, dtype=torch.float32, lse_grad=True):
    shapes, build = CALLS[name]
    mask = build()
    q, k, v = _inputs(shapes, dtype)
    out, lse = portattn.attention(q, k, v, mask=mask, return_lse=True, kernel=NAME)
    ref = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    want, want_lse = portattn.attention(*ref, mask=mask, return_lse=True, kernel="reference")
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    empty = torch.isneginf(want_lse)
    assert (out[empty] == 0).all()
    torch.testing.assert_close(torch.where(empty, 0, lse.double()),
                               torch.where(empty, 0, want_lse), rtol=tol, atol=tol)
    grads = torch.autograd.grad(_loss(out, lse if lse_grad else lse.detach()), (q, k, v))
    want_grads = torch.autograd.grad(_loss(want, want_lse if lse_grad else want_lse.detach()),
                                     ref)
    for what, got, expected in zip("qkv", grads, want_grads, strict=True):
        scale = max(1.0, float(expected.abs().max()))
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * scale,
                                   msg=lambda m, w=what: f"d{w}: {m}")
    return q, k, v, mask


@pytest.mark.parametrize("name", sorted(CALLS))
def test_forward_and_gradients_against_the_reference(name, backend):
    _torch_cpu(backend)
    q, k, v, mask = _check(name)
    # the segments themselves ran, not the portable kernel's path for other ids
    assert plan_of(describe(q, k, v, mask=mask)) is not None


@pytest.mark.parametrize("name", ["documents_causal", "grouped_query", "padding"])
def test_gradients_of_the_output_alone(name, backend):
    _torch_cpu(backend)
    _check(name, lse_grad=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["documents_causal", "grouped_query", "key_lengths"])
def test_other_dtypes(name, dtype, backend):
    _torch_cpu(backend)
    _check(name, dtype)


def test_lse_is_float32_for_half_inputs(backend):
    _torch_cpu(backend)
    shapes, build = CALLS["documents_causal"]
    q, k, v = (x.detach() for x in _inputs(shapes, torch.bfloat16))
    _, lse = portattn.attention(q, k, v, mask=build(), return_lse=True, kernel=NAME)
    assert lse.dtype == torch.float32


def test_ids_that_are_not_block_diagonal_run_the_portable_path(backend, monkeypatch):
    # document 0's keys come in two runs: no segment plan; the portable flash kernel
    # (with its backward) computes the call instead
    _torch_cpu(backend)
    from portattn_torch import _segments_kernel

    ids = torch.tensor([0] * 10 + [1] * 15 + [0] * 20 + [2] * 5)
    monkeypatch.setitem(CALLS, "split_document", ((2, 4, 4, 50, 50, 16, 16),
                                                  lambda: masks.causal() & masks.documents(ids)))
    ran = []
    attach = _segments_kernel.attach_for
    monkeypatch.setattr(_segments_kernel, "attach_for",
                        lambda namespace: ran.append(namespace) or attach(namespace))
    q, k, v, mask = _check("split_document")
    assert plan_of(describe(q, k, v, mask=mask)) is None
    assert ran == ["torch"]


def test_plan_of_packed_documents():
    q = torch.zeros(2, 1, 12, 4)
    mask = masks.causal() & masks.documents(torch.tensor([[0] * 5 + [1] * 7,
                                                          [3] * 2 + [-1] * 4 + [4] * 6]))
    plan = plan_of(describe(q, q, q, mask=mask))
    first, second = (segments for _, segments in plan.groups)
    assert [(s.q0, s.q1, s.k0, s.k1, s.shift) for s in first] == [(0, 5, 0, 5, 0),
                                                                   (5, 12, 5, 12, 0)]
    assert [(s.q0, s.q1, s.k0, s.k1, s.shift) for s in second] == [(0, 2, 0, 2, 0),
                                                                    (6, 12, 6, 12, 0)]
    assert sum(s.pairs for s in first) == 15 + 28


def test_plan_of_shared_ids_is_one_group():
    q = torch.zeros(3, 1, 12, 4)
    mask = masks.documents(torch.tensor([0] * 5 + [1] * 7))
    plan = plan_of(describe(q, q, q, mask=mask))
    assert len(plan.groups) == 1
    assert plan.groups[0][0] == slice(None)
    assert [(s.q0, s.q1, s.k0, s.k1, s.shift) for s in plan.groups[0][1]] == [
        (0, 5, 0, 5, None), (5, 12, 5, 12, None)]


def test_dispatch_chooses_it_for_packed_documents():
    q = torch.zeros(1, 8, 1024, 64)
    mask = masks.causal() & masks.documents(_ids(300, 400, 324))
    assert portattn.explain(q, q, q, mask=mask).kernel.name == NAME
    grad = q.clone().requires_grad_(True)
    assert portattn.explain(grad, grad, grad, mask=mask).kernel.name == NAME
    plan = portattn.explain(q, q, q, mask=masks.causal())
    assert plan.kernel.name != NAME
    why = dict((e.name, w) for e, w in plan.candidates)[NAME]
    assert any("no documents mask" in w for w in why)


def test_calls_whose_values_cannot_be_read_are_refused(monkeypatch):
    q = torch.zeros(1, 2, 64, 16)
    mask = masks.causal() & masks.documents(_ids(30, 34))
    monkeypatch.setattr(AttentionInputs, "values_readable", property(lambda self: False))
    why = TorchSegmentsKernel.not_supported_reasons(describe(q, q, q, mask=mask))
    assert any("values not readable" in w for w in why), why


def test_causal_with_a_scale_that_is_not_positive_is_refused():
    q = torch.zeros(1, 2, 64, 16)
    mask = masks.causal() & masks.documents(_ids(30, 34))
    why = TorchSegmentsKernel.not_supported_reasons(describe(q, q, q, mask=mask, scale=0.0))
    assert any("scale=0.0" in w for w in why), why


def test_a_nan_hidden_inside_a_document_gives_the_clean_answer(backend):
    # torch's CPU flash kernel lets a key hidden by the causal mask reach its rows as
    # 0 * NaN; dispatch checks the output and runs another kernel for the call
    _torch_cpu(backend)
    shapes, build = CALLS["documents_causal"]
    q, k, v = (x.detach() for x in _inputs(shapes))
    mask = build()
    clean = portattn.attention(q, k, v, mask=mask)
    v[:, :, 40] = math.nan  # document 2's sixth key: rows 35..39 of it do not see it
    out = portattn.attention(q, k, v, mask=mask)
    seen = torch.zeros(70, dtype=torch.bool)
    seen[40:53] = True
    assert torch.isnan(out[:, :, seen]).all()
    torch.testing.assert_close(out[:, :, ~seen], clean[:, :, ~seen])


def test_a_nan_in_another_document_never_reaches_a_row(backend):
    _torch_cpu(backend)
    shapes, build = CALLS["documents"]
    q, k, v = (x.detach() for x in _inputs(shapes))
    mask = build()
    kernel = TorchSegmentsKernel()
    clean, _, _ = kernel.run(describe(q, k, v, mask=mask))
    k[:, :, 60] = math.nan  # document 3 (positions 53..69)
    out, _, _ = kernel.run(describe(q, k, v, mask=mask))
    torch.testing.assert_close(out[:, :, :53], clean[:, :, :53])
    assert torch.isnan(out[:, :, 53:]).all()
