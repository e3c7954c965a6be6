"""An additive bias: read with its strides (0 along broadcast axes), added after the
softcap and before the mask, summed in float32 (a float32 bias on half inputs keeps its
precision), with its gradient; against portattn's reference kernel in float64."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from portattn_triton import BackwardConfig, Config, flash_attention, flash_backward, flash_forward

import portattn
from portattn import masks
from portattn.testing import assert_close

sys.path.insert(0, str(Path(__file__).parent))
from maskcases import MASKS, inputs, reference
from textbook import GRAD_TOLERANCE

SMALL = Config(16, 16, 1, 1)
BACKWARD = BackwardConfig(Config(16, 32, 1, 1), Config(32, 16, 1, 1))

#: bias shapes for batch (2,), 4 query heads, 40 queries, 70 keys
SHAPES = {"full": (2, 4, 40, 70), "heads": (4, 40, 70), "pairs": (40, 70),
          "key_padding": (2, 1, 1, 70), "per_query": (40, 1), "per_head": (4, 1, 1)}


def _bias(shape, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("path", ["pointer", "tma", "decode"])
def test_bias_shapes(shape, path):
    lq = 2 if path == "decode" else 40
    dims = (*SHAPES[shape][:-2], min(SHAPES[shape][-2], lq), SHAPES[shape][-1])
    q, k, v = inputs(torch.float32, (2,), 4, 2, lq, 70, 16)
    bias = _bias(dims, torch.float32)
    mask = masks.causal()
    out, lse = flash_forward(q, k, v, bias=bias, mask=mask, config=SMALL, path=path,
                             num_splits=2 if path == "decode" else None)
    want_out, want_lse = reference(q, k, v, bias=bias.double(), mask=mask)
    assert_close(out, want_out.numpy(), "float32", "out")
    assert_close(lse, want_lse.numpy(), "float32", "lse")


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
def test_half_inputs_sum_the_bias_in_float32(bias_dtype):
    q, k, v = inputs(torch.float16, (1,), 2, 2, 40, 50, 16)
    # large offsets that float16 would round by up to 0.25: the result would move
    bias = _bias((2, 40, 50), torch.float64) * 0.01 + 1000.0
    out, lse = flash_forward(q, k, v, bias=bias.to(bias_dtype), config=SMALL, softcap=2.0)
    want_out, want_lse = reference(q, k, v, bias=bias.to(bias_dtype).double(), softcap=2.0)
    assert_close(out, want_out.numpy(), "float16", "out")
    assert_close(lse, want_lse.numpy(), "float16", "lse")


def test_bias_with_a_mask_of_bit_tiles_and_softcap():
    q, k, v = inputs(torch.float32, (2,), 4, 2, 40, 70, 16)
    mask = MASKS["global_window"]((2,), 4, 40, 70)
    bias = _bias((4, 40, 70), torch.float32)
    out, lse = flash_forward(q, k, v, bias=bias, mask=mask, softcap=4.0, config=SMALL)
    want_out, want_lse = reference(q, k, v, bias=bias.double(), mask=mask, softcap=4.0)
    assert_close(out, want_out.numpy(), "float32", "out")
    assert_close(lse, want_lse.numpy(), "float32", "lse")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", ["pointer", "tma", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_minus_inf_bias_hides_a_nan_value(path, dtype):
    # Key 20's value is NaN; the bias hides it from rows 0 and 1 (-inf), row 2 sees it.
    q, k, v = inputs(dtype, (1,), 2, 2, 3, 40, 16)
    bias = torch.zeros(3, 40)
    bias[:2, 20] = float("-inf")
    options = {"bias": bias, "config": SMALL, "path": path,
               "num_splits": 2 if path == "decode" else None}
    clean = flash_forward(q, k, v, **options)
    v[..., 20, :] = float("nan")
    out, _ = flash_forward(q, k, v, **options)
    assert torch.equal(out[..., :2, :], clean[0][..., :2, :])
    assert out[..., 2, :].isnan().all()


def test_bad_bias_shape_is_named():
    q = k = v = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="bias of shape"):
        flash_forward(q, k, v, bias=torch.zeros(3, 8, 8))
    with pytest.raises(ValueError, match="bias_grad=True needs a bias"):
        flash_backward(q, k, v, q, q[..., 0], q, bias_grad=True)


# --- gradients -------------------------------------------------------------------------

def _grads(outputs, leaves, grads):
    return torch.autograd.grad(outputs, leaves, grads, allow_unused=True,
                               materialize_grads=True)


@pytest.mark.parametrize("shape", ["full", "heads", "key_padding", "per_query"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bias_gradient(shape, dtype):
    torch_dtype = getattr(torch, dtype)
    q, k, v = inputs(torch_dtype, (2,), 4, 2, 40, 70, 16)
    bias = _bias(SHAPES[shape], torch.float32)
    mask = MASKS["causal_documents"]((2,), 4, 40, 70)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out, lse = flash_attention(*leaves[:3], bias=leaves[3], mask=mask, softcap=5.0,
                               config=SMALL, backward_config=BACKWARD)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    want_out, want_lse = reference(*exact[:3], bias=exact[3], mask=mask, softcap=5.0)
    gen = torch.Generator().manual_seed(7)
    dout = torch.randn(want_out.shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn(want_lse.shape, generator=gen, dtype=torch.float64)
    dlse = torch.where(want_lse.isinf(), 0.0, dlse)
    got = _grads([out, lse], leaves, [dout.to(out.dtype), dlse.float()])
    want = _grads([want_out, want_lse], exact, [dout, dlse])
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want, strict=True):
        assert a.shape == b.shape, name
        err = (a.double() - b).abs().max().item()
        limit = GRAD_TOLERANCE[dtype] * max(1.0, b.abs().max().item())
        assert err <= limit, f"{name}: max |error| {err:.3g} > {limit:.3g}"
    assert leaves[3].dtype == got[3].dtype


def test_bias_gradient_through_dispatch():
    q, k, v = inputs(torch.float32, (1,), 2, 2, 30, 30, 16)
    bias = _bias((2, 30, 30), torch.float32).requires_grad_()
    out = portattn.attention(q, k, v, bias=bias, mask=masks.causal(), kernel="triton_flash")
    (grad,) = torch.autograd.grad(out.sum(), bias)
    exact = bias.detach().double().requires_grad_()
    want = reference(q, k, v, bias=exact, mask=masks.causal())[0]
    (want_grad,) = torch.autograd.grad(want.sum(), exact)
    torch.testing.assert_close(grad.double(), want_grad, rtol=2e-5, atol=2e-5)
