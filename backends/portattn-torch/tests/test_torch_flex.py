"""torch_flex against the float64 reference: the conformance kit on every declared
kind, fully masked rows, the rule for non-finite inputs (on the CPU by the portable
kernel, on CUDA on the device), and (on CUDA, where torch's flex has a backward)
gradients of the output and the lse.

torch.compile on a CPU takes seconds per kind of call: the kit compiles once per
mask structure, dtype and head dim (a few minutes in all)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from flexcases import AnyCall, for_device

from portattn.testing import assert_close, check_case, conformance_cases
from portattn.testing.plugin import require_library

torch = require_library("torch")

import portattn  # noqa: E402
import portattn.autograd  # noqa: E402
from portattn import masks  # noqa: E402
from portattn.kernel import AttentionInputs, describe  # noqa: E402

# torch.compile imports modules of torch's that use its own deprecated APIs
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _torch_only(backend):
    if backend.namespace != "torch":
        pytest.skip(f"torch_flex does not run on {backend.namespace}")
    return backend.device


@pytest.mark.parametrize("case", conformance_cases(AnyCall), ids=str)
def test_conformance(case, backend):
    kernel = for_device(backend.device_kind)
    # torch's CPU flex gives no lse: the same cases without it there
    check_case(kernel, case if kernel.returns_lse else replace(case, lse=False), backend)


def _qkv(device, lq=200, lk=200, hq=4, hkv=4, d=16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, hq, lq, d), (2, hkv, lk, d), (2, hkv, lk, d))
    return tuple(torch.randn(s, generator=g).to(device).requires_grad_(grad) for s in shapes)


def _reference(q, k, v, **kwargs):
    """float64 ``(out, lse)`` on the CPU, recorded for autograd where the inputs are."""
    args = [x.detach().cpu().double().requires_grad_(x.requires_grad) for x in (q, k, v)]
    out, lse = portattn.attention(*args, kernel="reference", return_lse=True, **kwargs)
    return args, out, lse


def _run(kernel, q, k, v, **kwargs):
    out, lse, _ = kernel().run(describe(q, k, v, return_lse=kernel.returns_lse, **kwargs))
    return out, lse


FULLY_MASKED = {
    "long_queries_bottom_right": lambda: {"mask": masks.causal()},
    "query_lengths": lambda: {"mask": masks.sliding_window(20) & masks.query_lengths(
        torch.tensor([200, 130]))},
    "padding_documents": lambda: {"mask": masks.documents(
        torch.tensor([0] * 90 + [-1] * 70 + [1] * 40))},
}


@pytest.mark.parametrize("name", sorted(FULLY_MASKED))
def test_fully_masked_rows_give_zero_and_minus_infinity(name, backend):
    device = _torch_only(backend)
    kernel = for_device(backend.device_kind)
    lk = 120 if name == "long_queries_bottom_right" else 200
    kwargs = FULLY_MASKED[name]()
    if device is not None:
        kwargs = {"mask": kwargs["mask"].with_arrays([a.to(device)
                                                      for a in kwargs["mask"].arrays])}
    q, k, v = _qkv(device, lk=lk, grad=kernel.grad)
    out, lse = _run(kernel, q, k, v, **kwargs)
    _, want, want_lse = _reference(q, k, v, **FULLY_MASKED[name]())
    empty = torch.isneginf(want_lse)
    assert empty.any(), "the case must have fully masked rows"
    assert torch.equal(out.detach().cpu()[empty], torch.zeros_like(out.detach().cpu()[empty]))
    assert_close(out.detach().cpu(), want.detach().numpy(), "float32", "out")
    if lse is not None:
        assert torch.isneginf(lse.detach().cpu()[empty]).all()
        assert_close(lse.detach().cpu(), want_lse.detach().numpy(), "float32", "lse")
    if kernel.grad:
        out.sum().backward()
        for x in (q, k, v):
            assert torch.isfinite(x.grad).all()
        assert (q.grad.cpu()[empty] == 0).all()


NONFINITE = ("hidden_by_mask", "hidden_by_bias", "nan_query", "overflowing_scores")


@pytest.mark.parametrize("name", NONFINITE)
def test_nonfinite_inputs_follow_the_rule(name, backend):
    device = _torch_only(backend)
    kernel = for_device(backend.device_kind)
    q, k, v = _qkv(device, lq=64, lk=64)
    clean = (q.clone(), k.clone(), v.clone())
    kwargs = {"mask": masks.causal()}
    nan_rows = torch.zeros(64, dtype=torch.bool)
    if name.startswith("hidden"):
        k[:, :, 50:] = math.nan  # hidden from every row (key lengths 40, or the bias)
        v[:, :, 55] = math.inf
        v[:, :, 30] = math.nan  # visible to rows >= 30 under the causal mask
        nan_rows[30:] = True
    if name == "hidden_by_mask":
        kwargs["mask"] = kwargs["mask"] & masks.key_lengths(torch.tensor([40, 40],
                                                                         device=device))
    elif name == "hidden_by_bias":
        bias = torch.zeros(64, 64, device=device)
        bias[:, 40:] = -math.inf
        kwargs["bias"] = bias
    elif name == "nan_query":
        q[:, :, 7] = math.nan
        nan_rows[7] = True
    else:
        k[:, :, 3], clean[1][:, :, 3] = 1e20, 1e20  # large scores, still finite
        q[:, :, 9] = 1e20  # but row 9 meets one of about 1e41 > float32's range
        nan_rows[9] = True
    out, _ = _run(kernel, q, k, v, **kwargs)
    want, _ = _run(kernel, *clean, **kwargs)
    out, want = out.cpu(), want.cpu()
    assert (~torch.isfinite(out[:, :, nan_rows])).all(), "these rows must not be finite"
    assert torch.isfinite(out[:, :, ~nan_rows]).all()
    assert_close(out[:, :, ~nan_rows], want[:, :, ~nan_rows].double().numpy(), "float32")


def test_cpu_calls_with_finite_inputs_run_flex(monkeypatch):
    from portattn_torch import _flex_kernel

    def refuse(inputs):
        msg = "the portable kernel ran a finite call"
        raise AssertionError(msg)

    monkeypatch.setattr(_flex_kernel, "flash_forward", refuse)
    q, k, v = _qkv("cpu")
    out, _ = _run(for_device("cpu"), q, k, v, mask=masks.sliding_window(30))
    _, want, _ = _reference(q, k, v, mask=masks.sliding_window(30))
    assert_close(out, want.detach().numpy(), "float32")


def test_cpu_calls_whose_values_cannot_be_read_run_the_portable_kernel(monkeypatch):
    # under torch.compile: torch's CPU flex would lose NaN scores, and nothing can be
    # read to rule them out
    from portattn_torch import _flex_kernel

    ran = []
    monkeypatch.setattr(AttentionInputs, "values_readable", property(lambda self: False))
    monkeypatch.setattr(_flex_kernel, "flash_forward",
                        lambda inputs: ran.append(1) or portattn.autograd.flash_forward(inputs))
    q, k, v = _qkv("cpu")
    out, _ = _run(for_device("cpu"), q, k, v, mask=masks.sliding_window(30))
    assert ran
    _, want, _ = _reference(q, k, v, mask=masks.sliding_window(30))
    assert_close(out, want.detach().numpy(), "float32")


ALIBI = {
    "documents": lambda device: {"mask": _documents(device)},
    "window_or_globals_cross": lambda device: {"mask": _globals_and_window(device)},
    "softcap_and_bias": lambda device: {"mask": masks.causal(), "softcap": 2.0,
                                        "bias": torch.linspace(-1, 1, 200, device=device)},
}


@pytest.mark.parametrize("name", sorted(ALIBI))
def test_alibi_over_many_tiles(name, backend):
    # slopes per batch element and head; queries shorter than keys in the cross case,
    # so the offset Lk - Lq moves every distance
    device = _torch_only(backend)
    kernel = for_device(backend.device_kind)
    lq = 150 if name.endswith("cross") else 200
    q, k, v = _qkv(device, lq=lq)
    slopes = torch.linspace(0.05, 0.8, 8).reshape(2, 4).to(device)
    kwargs = {**ALIBI[name](device), "alibi_slopes": slopes}
    out, lse = _run(kernel, q, k, v, **kwargs)
    cpu = {n: a.cpu() if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()}
    cpu["mask"] = kwargs["mask"].with_arrays([a.cpu() for a in kwargs["mask"].arrays])
    cpu["alibi_slopes"] = slopes.cpu().double()
    _, want, want_lse = _reference(q, k, v, **cpu)
    assert_close(out.detach().cpu(), want.detach().numpy(), "float32", "out")
    if lse is not None:
        visible = torch.isfinite(want_lse)
        assert_close(lse.detach().cpu()[visible], want_lse.detach()[visible].numpy(),
                     "float32", "lse")


def _documents(device):
    ids = torch.tensor([0] * 70 + [1] * 50 + [2] * 60 + [-1] * 20, device=device)
    return masks.causal() & masks.documents(ids)


def _globals_and_window(device):
    return masks.sliding_window(24, 8) | masks.global_tokens(
        torch.tensor([0, 97, 150], device=device))


def _strided(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (((q_idx - kv_idx) % 5 == 0) | (kv_idx < 4 + h))


GRADIENTS = {
    "documents": lambda device: ({"mask": _documents(device)}, {}),
    "global_tokens_or_window": lambda device: ({"mask": _globals_and_window(device)}, {}),
    "mask_function": lambda device: ({"mask": masks.function(_strided)}, {}),
    "softcap": lambda device: ({"mask": masks.causal(), "softcap": 2.0, "scale": 1.0}, {}),
    "grouped_query": lambda device: ({"mask": masks.sliding_window(40)}, {"hq": 6, "hkv": 2}),
    "alibi_grouped_query": lambda device: (
        {"mask": _documents(device), "alibi_slopes": torch.linspace(0.1, 0.6, 6, device=device)},
        {"hq": 6, "hkv": 2}),
}


@pytest.mark.parametrize("name", sorted(GRADIENTS))
def test_gradients_of_out_and_lse(name, backend):
    device = _torch_only(backend)
    if backend.device_kind == "cpu":
        pytest.skip("torch's compiled CPU flex has no backward (torch_flex refuses there)")
    kwargs, shape = GRADIENTS[name](device)
    q, k, v = _qkv(device, grad=True, **shape)
    out, lse = _run(AnyCall, q, k, v, **kwargs)
    cpu_kwargs = {n: a.cpu() if isinstance(a, torch.Tensor) else a
                  for n, a in kwargs.items() if n != "mask"}
    mask = kwargs["mask"]
    cpu_kwargs["mask"] = mask.with_arrays([a.cpu() for a in mask.arrays])
    args, want, want_lse = _reference(q, k, v, **cpu_kwargs)
    g = torch.Generator().manual_seed(1)
    d_out = torch.randn(want.shape, generator=g, dtype=torch.float64)
    d_lse = torch.randn(want_lse.shape, generator=g, dtype=torch.float64)
    visible = torch.isfinite(want_lse)
    assert_close(out.detach().cpu(), want.detach().numpy(), "float32", "out")
    assert_close(lse.detach().cpu()[visible], want_lse.detach()[visible].numpy(), "float32",
                 "lse")
    ((out * d_out.to(device, torch.float32)).sum()
     + (torch.where(torch.isfinite(lse), lse, 0) * d_lse.to(device, torch.float32)).sum()
     ).backward()
    ((want * d_out).sum() + (torch.where(visible, want_lse, 0) * d_lse).sum()).backward()
    for name_, ours, ref in zip("qkv", (q, k, v), args, strict=True):
        assert_close(ours.grad.cpu(), ref.grad.numpy(), "float32", f"d{name_}")


def _broadcast_over_heads(score, b, h, q_idx, kv_idx, weight):
    return score * weight  # weight (H, 1, 1): right on tiles, not one score at a time


def _indexed_by_head(score, b, h, q_idx, kv_idx, weight):
    return score * weight[h, 0, 0]


def test_score_functions_run_one_score_at_a_time(backend):
    device = _torch_only(backend)
    from portattn import scores

    q, k, v = _qkv(device, lq=128, lk=128)
    weight = torch.linspace(0.5, 1.5, 4, device=device).reshape(4, 1, 1)
    refused = scores.function(_broadcast_over_heads, (weight,))
    why = AnyCall.not_supported_reasons(describe(q, k, v, score_mod=refused))
    assert any("gives shape (4, 1, 1) for one score" in w for w in why), why
    # the portable kernels take it as it is, and flex takes it indexed by head
    kernel = for_device(backend.device_kind)
    indexed = scores.function(_indexed_by_head, (weight,))
    got, _ = _run(kernel, q, k, v, mask=masks.causal(), score_mod=indexed)
    want = portattn.attention(q, k, v, mask=masks.causal(), score_mod=refused, kernel="tiled")
    assert_close(got, want.double().cpu().numpy(), "float32")
