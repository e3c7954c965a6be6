"""The tiled kernel's flash backward in torch autograd: exact, O(L) saved, compiled."""

from __future__ import annotations

import math

import pytest

from portattn.testing.plugin import require_library

torch = require_library("torch")

import portattn  # noqa: E402
from portattn import masks  # noqa: E402

#: (rtol, atol) of gradients against float64 autograd of the textbook formula.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2),
              torch.bfloat16: (1e-1, 1e-1)}

MASKS = {
    "none": lambda b, lq, lk: None,
    "causal": lambda b, lq, lk: masks.causal(),
    "causal_top_left": lambda b, lq, lk: masks.causal("top_left"),
    "window_and_lengths": lambda b, lq, lk: masks.sliding_window(40, 3)
    & masks.key_lengths(torch.tensor([lk, lk // 3])[:b]),
    "query_lengths": lambda b, lq, lk: masks.query_lengths(torch.tensor([lq // 2, 0])[:b]),
    "dense": lambda b, lq, lk: masks.dense(
        torch.rand(b, 1, lq, lk, generator=torch.Generator().manual_seed(5)) < 0.3),
}


def textbook(q, k, v, mask, bias, scale, softcap):
    """Plain attention in the inputs' dtype; torch autograd differentiates it."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    lq, lk = q.shape[-2], k.shape[-2]
    if mask is not None:
        bound = mask.bind(_xp(), q.shape[:-3], q.shape[-3], lq, lk)
        allowed = bound.tile(_xp(), 0, lq, 0, lk, lq, lk)
        s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows without keys: 0
    lse = torch.logsumexp(s, dim=-1)
    return p @ v, torch.where(torch.isinf(lse), 0.0, lse)


def _xp():
    from array_api_compat import array_namespace

    return array_namespace(torch.empty(0))


def _tensors(dtype, batch=2, hq=4, hkv=2, lq=150, lk=300, d=16, dv=24, bias=False,
             seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, hq, lq, d), (batch, hkv, lk, d), (batch, hkv, lk, dv)]
    if bias:
        shapes.append((hq, lq, lk))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for s in shapes]


def _loss(out, lse, seed=1):
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    lse = torch.where(torch.isinf(lse), 0.0, lse)
    return (out * w_out).sum() + (lse * w_lse).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=str)
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_gradients_match_float64_textbook(mask, softcap, dtype):
    tensors = _tensors(dtype, bias=mask in ("none", "causal"), seed=len(mask))
    m = MASKS[mask](2, 150, 300)
    q, k, v, *bias = tensors
    out, lse = portattn.attention(q, k, v, mask=m, bias=bias[0] if bias else None,
                                  softcap=softcap, return_lse=True, kernel="tiled")
    assert out.dtype == dtype
    assert lse.dtype == torch.float32
    got = torch.autograd.grad(_loss(out, lse), tensors)
    exact = [t.detach().double().requires_grad_() for t in tensors]
    want_out, want_lse = textbook(*exact[:3], m, exact[3] if bias else None,
                                  1 / math.sqrt(16), softcap)
    want = torch.autograd.grad(_loss(want_out, want_lse), exact)
    rtol, atol = TOLERANCES[dtype]
    for name, g, w, t in zip("qkvb", got, want, tensors, strict=False):
        assert g.dtype == t.dtype
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol, msg=f"d{name}")


@pytest.mark.parametrize("mask", ["causal", "window_and_lengths", "query_lengths"])
def test_gradcheck_float64(mask):
    q, k, v, b = _tensors(torch.float64, batch=2, hq=2, hkv=1, lq=5, lk=7, d=3, dv=2,
                          bias=True)

    def f(q, k, v, b):
        out, lse = portattn.attention(q, k, v, mask=MASKS[mask](2, 5, 7), bias=b,
                                      softcap=2.0, return_lse=True, kernel="tiled")
        return out, torch.where(torch.isinf(lse), 0.0, lse)

    assert torch.autograd.gradcheck(f, (q, k, v, b))


def test_only_inputs_output_and_lse_are_saved():
    q, k, v = _tensors(torch.float32, batch=1, lq=700, lk=900)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                  lambda t: t):
        out = portattn.attention(q, k, v, mask=masks.causal(), kernel="tiled")
    lse_numel = out.numel() // out.shape[-1]
    assert sum(t.numel() for t in saved) == (
        q.numel() + k.numel() + v.numel() + out.numel() + lse_numel)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_fully_masked_rows_and_empty_calls_get_zero_gradients():
    q, k, v = _tensors(torch.float32, batch=1, lq=20, lk=6)
    out = portattn.attention(q, k, v, mask=masks.causal(), kernel="tiled")
    out.sum().backward()
    assert (q.grad[..., :14, :] == 0).all()
    assert torch.isfinite(k.grad).all()
    for lq, lk in ((0, 6), (5, 0)):
        q, k, v = _tensors(torch.float32, batch=1, lq=lq, lk=lk)
        out = portattn.attention(q, k, v)
        out.sum().backward()
        assert [t.grad.abs().sum().item() for t in (q, k, v)] == [0.0, 0.0, 0.0]


def test_dispatch_sends_gradients_through_windows_to_the_flash_backward():
    q, k, v = _tensors(torch.float32, batch=2, lq=600, lk=600, d=8, dv=8)
    window = masks.sliding_window(16) & masks.key_lengths(torch.tensor([600, 30]))
    plan = portattn.explain(q, k, v, mask=window)
    assert plan.kernel.name == "tiled"
    reasons = dict((e.name, why) for e, why in plan.candidates)["torch_sdpa"]
    assert any("sliding window" in r for r in reasons)
    assert portattn.explain(q.detach(), k.detach(), v.detach(),
                            mask=window).kernel.name == "torch_sdpa"
    assert portattn.explain(q, k, v, mask=masks.causal()).kernel.name == "torch_sdpa"
    small = [t[..., :64, :] for t in (q, k, v)]  # SDPA is faster there
    assert portattn.explain(*small, mask=masks.sliding_window(16)).kernel.name == "torch_sdpa"


# Warnings of torch's own, raised while dynamo traces (none is about portattn's code):
# it traces through array-api-compat's lru_cache, instantiates autograd functions, and
# reads .grad of the tensors it hands to a resumed frame.
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_torch_compile_trains_through_the_flash_backward():
    def layer(q, k, v):
        out, lse = portattn.attention(q, k, v, mask=masks.causal(), softcap=5.0,
                                      return_lse=True)
        return (out * out).sum() + lse.sum()

    tensors = _tensors(torch.float32, batch=1, hq=2, hkv=1, lq=40, lk=40, d=8, dv=8)
    portattn.kernels()  # discovered eagerly: dynamo would trace the plugin imports
    want = torch.autograd.grad(layer(*tensors), tensors)
    compiled = torch.compile(layer, backend="aot_eager")
    got = torch.autograd.grad(compiled(*tensors), tensors)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
