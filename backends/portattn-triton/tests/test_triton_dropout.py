"""Dropout in the Triton kernels (under the interpreter): the pairs every portattn kernel
drops for a seed, in the forward and again in both backward passes, on the table-free
band loops and on table rows with bit tiles; against the reference kernel given the
same seed, differentiated by torch in float64."""

from __future__ import annotations

import pytest
import torch

import portattn
from portattn import dropout, masks


def _inputs(hq=4, hkv=2, lq=50, lk=50, d=16):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen) for s in ((2, hq, lq, d), (2, hkv, lk, d),
                                                     (2, hkv, lk, d))]


def _run(kernel, q, k, v, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = portattn.attention(*leaves, return_lse=True, kernel=kernel, **kwargs)
    gen = torch.Generator().manual_seed(1)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    grads = torch.autograd.grad((out * dout.to(out.dtype)).sum() + (lse * dlse).sum(), leaves)
    return out, lse, *grads


MASKS = {
    "none": lambda: None,
    "causal": masks.causal,  # table-free band loops
    "window": lambda: masks.sliding_window(7),
    "documents": lambda: masks.causal() & masks.documents(  # table rows and bit tiles
        torch.tensor([[0] * 17 + [1] * 33, [0] * 40 + [2] * 10])),
}


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("p", [0.2, 0.6])
def test_forward_and_gradients_drop_the_reference_pairs(mask, p):
    q, k, v = _inputs()
    options = {"mask": MASKS[mask](), "dropout_p": p, "dropout_seed": 29}
    got = _run("triton_flash", q, k, v, **options)
    want = _run("reference", *(t.double() for t in (q, k, v)), **options)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5, msg=name)


def test_a_dropped_pair_is_one_the_mask_keeps_out():
    """The output is the dropped weights times the values: with ``p`` near 1 nearly
    everything is dropped, and what is left is exactly the reference's."""
    q, k, v = _inputs(hq=2, hkv=2)
    out = portattn.attention(q, k, v, dropout_p=0.95, dropout_seed=3, kernel="triton_flash")
    kept = dropout.mask(q, k, dropout_p=0.95, dropout_seed=3)
    weights = portattn.attention(q.double(), k.double(), v.double(), return_weights=True,
                                 kernel="reference")[1]
    want = (weights * kept / 0.05) @ v.double()
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_float16_and_grouped_queries():
    q, k, v = (t.half() for t in _inputs(hq=6, hkv=2, lq=40, lk=70, d=32))
    options = {"mask": masks.causal(), "dropout_p": 0.3, "dropout_seed": 5}
    got = _run("triton_flash", q, k, v, **options)
    want = _run("reference", *(t.double() for t in (q, k, v)), **options)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2, msg=name)


def test_without_a_seed_torch_draws_one_and_the_backward_uses_it():
    pytest.importorskip("portattn_torch")  # which draws seeds from torch's generator
    q, k, v = _inputs()
    torch.manual_seed(8)
    got = _run("triton_flash", q, k, v, dropout_p=0.4)
    torch.manual_seed(8)
    words = dropout.seed_words(portattn.explain(q, k, v, dropout_p=0.4).inputs)
    want = _run("reference", *(t.double() for t in (q, k, v)), dropout_p=0.4,
                dropout_seed=words)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5, msg=name)


def test_dropout_takes_the_pointer_path():
    """A decode-shaped call with dropout runs on the pointer path (the split-KV and
    tensor-descriptor kernels take no dropout) and drops the reference's pairs."""
    from portattn_triton._launch import forward
    from portattn_triton._plan import plan_for
    from portattn_triton._triton_dropout import Dropout

    q, k, v = _inputs()
    q = q[..., :1, :]
    with pytest.raises(ValueError, match="dropout runs on the pointer path; got path='decode'"):
        forward(q, k, v, plan_for(q, k), scale=None, softcap=None, path="decode",
                dropout=Dropout(torch.tensor([7], dtype=torch.int32), 0.1))
    options = {"dropout_p": 0.5, "dropout_seed": 12}
    got = portattn.attention(q, k, v, kernel="triton_flash", **options)
    want = portattn.attention(q.double(), k.double(), v.double(), kernel="reference",
                              **options)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
