"""Gradients through ``portattn.attention(..., kernel="triton_flash")`` and what the
kernel declares about them."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from portattn_triton import TritonFlashKernel

import portattn
from portattn import masks
from portattn.kernel import describe

sys.path.insert(0, str(Path(__file__).parent))
from textbook import GRAD_TOLERANCE, textbook


def _grads(outputs, leaves, grads):
    return torch.autograd.grad(outputs, leaves, grads, allow_unused=True,
                               materialize_grads=True)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_attention_with_lse_gradients(dtype):
    # the sub-problem query[40:70] x key[20:60] of a causal 100 x 100 problem:
    # global positions 40 + i and 20 + j, so j - i <= 20
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, n, 32, generator=gen, dtype=torch.float64)
               for n in (30, 40, 40))
    mask = masks.causal().restrict(torch, 40, 70, 20, 60, 100, 100)
    lengths = torch.tensor([40, 25])
    mask = mask & masks.key_lengths(lengths)
    leaves = [t.to(getattr(torch, dtype)).requires_grad_() for t in (q, k[:, :2], v[:, :2])]
    out, lse = portattn.attention(*leaves, mask=mask, return_lse=True, softcap=3.0,
                                  kernel="triton_flash")
    exact = [t.detach().double().requires_grad_() for t in leaves]
    want_out, want_lse = textbook(*exact, 1 / math.sqrt(32), None, 20, 3.0, lengths, None)
    dout, dlse = torch.randn_like(want_out), torch.randn_like(want_lse)
    got = _grads([out, lse], leaves, [dout.to(out.dtype), dlse.float()])
    want = _grads([want_out, want_lse], exact, [dout, dlse])
    for a, b in zip(got, want, strict=True):
        err = (a.double() - b).abs().max().item()
        assert err <= GRAD_TOLERANCE[dtype] * max(1.0, b.abs().max().item())


def test_attention_without_grad_builds_no_graph():
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    assert portattn.attention(q, k, v, kernel="triton_flash").grad_fn is None
    q.requires_grad_()
    with torch.no_grad():
        assert portattn.attention(q, k, v, kernel="triton_flash").grad_fn is None
    assert portattn.attention(q, k, v, kernel="triton_flash").grad_fn is not None


def _inputs(namespace):
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    return describe(q, k, v)._replace(namespace=namespace, requires_grad=True)


def test_declares_gradients_for_torch():
    assert TritonFlashKernel.grad
    assert TritonFlashKernel.deterministic
    assert TritonFlashKernel.not_supported_reasons(_inputs("torch")) == []


@pytest.mark.parametrize("namespace", ["jax", "cupy"])
def test_refuses_gradients_without_torch_autograd(namespace):
    reasons = TritonFlashKernel.not_supported_reasons(_inputs(namespace))
    assert reasons == [f"gradients on namespace={namespace} not supported "
                       "(torch autograd only)"]
