"""Gradients, dropout and torch.compile through ``portattn.attention``."""

from __future__ import annotations

import pytest

from portattn.testing.plugin import require_library

torch = require_library("torch")

import portattn  # noqa: E402
from portattn import masks  # noqa: E402

MASKS = {
    "none": lambda: None,
    "causal_top_left": lambda: masks.causal("top_left"),
    "causal_bottom_right_cross": lambda: masks.causal("bottom_right"),
    "window": lambda: masks.sliding_window(2, 1),
    "key_lengths": lambda: masks.key_lengths(torch.tensor([5, 0])),
    "query_lengths_and_causal": lambda: masks.query_lengths(torch.tensor([1, 4]))
    & masks.causal(),
    "dense": lambda: masks.dense(torch.rand(2, 1, 4, 5, generator=torch.Generator()
                                            .manual_seed(3)) < 0.6),
}


def _inputs(dtype, hq=4, hkv=2, lq=4, lk=5, d=4, dv=3, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, hq, lq, d), (2, hkv, lk, d), (2, hkv, lk, dv)]
    if bias:
        shapes.append((hq, lq, lk))
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_gradcheck_float64(mask, bias):
    tensors = _inputs(torch.float64, bias=bias)

    def f(q, k, v, b=None):
        return portattn.attention(q, k, v, mask=MASKS[mask](), bias=b, kernel="torch_sdpa")

    assert torch.autograd.gradcheck(f, tuple(tensors), fast_mode=True)


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_gradients_match_the_tiled_kernel(mask):
    tensors = _inputs(torch.float32, bias=True, seed=1)
    grads = {}
    for kernel in ("torch_sdpa", "tiled"):
        for t in tensors:
            t.grad = None
        out = portattn.attention(*tensors[:3], mask=MASKS[mask](), bias=tensors[3],
                                 kernel=kernel)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads[kernel] = [t.grad.clone() for t in tensors]
    for name, got, want in zip("qkvb", grads["torch_sdpa"], grads["tiled"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=f"d{name}")


def test_dispatch_keeps_torch_sdpa_for_gradients():
    q, k, v = _inputs(torch.float32)
    assert portattn.explain(q, k, v, mask=masks.causal()).kernel.name == "torch_sdpa"


def test_dropout_is_seeded_by_torch():
    q, k, v = _inputs(torch.float32)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(portattn.attention(q, k, v, dropout_p=0.5, kernel="torch_sdpa"))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_dropout_drops_weights_and_rescales():
    # Zero queries give uniform weights 1/Lk and values of one make each output the
    # kept fraction of keys divided by (1 - p): a multiple of 1/(Lk (1 - p)), mean 1.
    lk, p = 128, 0.5
    q = torch.zeros(1, 4, 64, 8)
    k = torch.randn(1, 4, lk, 8)
    v = torch.ones(1, 4, lk, 1)
    torch.manual_seed(0)
    out = portattn.attention(q, k, v, dropout_p=p)
    kept = out * lk * (1 - p)
    torch.testing.assert_close(kept, kept.round(), rtol=0, atol=1e-3)
    assert kept.min() < kept.max()  # rows drop different keys
    assert abs(out.mean().item() - 1.0) < 0.05  # std of the mean is about 0.006


def test_dropout_trains():
    q, k, v = _inputs(torch.float32)
    torch.manual_seed(0)
    portattn.attention(q, k, v, dropout_p=0.2).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# dynamo notes that it traces through array-api-compat's lru_cache (no effect on results).
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_torch_compile_runs():
    def layer(q, k, v):
        return portattn.attention(q, k, v, mask=masks.causal()) * 2

    q, k, v = (t.detach() for t in _inputs(torch.float32, hq=2, hkv=2, lq=8, lk=8, dv=6))
    # Discover the kernels eagerly: dynamo would otherwise trace plugin imports.
    want = layer(q, k, v)
    compiled = torch.compile(layer, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), want)
