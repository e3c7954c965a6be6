"""Gradients through the block form: the dK/dV pass reads the transposed table rows and
the dQ pass the direct ones, each on its own grid, with bit tiles in both; against
portattn's reference kernel differentiated by torch in float64."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from portattn_triton import BackwardConfig, Config, flash_attention

import portattn
from portattn import masks

sys.path.insert(0, str(Path(__file__).parent))
from maskcases import MASKS, inputs, reference
from textbook import GRAD_TOLERANCE

SMALL = Config(16, 16, 1, 1)
#: dK/dV over key blocks taller than query blocks, dQ the other way round.
MIXED = BackwardConfig(Config(16, 32, 1, 1), Config(32, 16, 1, 1))


def check(name, dtype="float32", batch=(2,), hq=4, hkv=2, lq=60, lk=60, d=16, path=None,
          mask=None, softcap=None):
    q, k, v = inputs(getattr(torch, dtype), batch, hq, hkv, lq, lk, d)
    mask = MASKS[name](batch, hq, lq, lk) if mask is None else mask
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if path is None:
        out, lse = flash_attention(*leaves, mask=mask, softcap=softcap, config=SMALL,
                                   backward_config=MIXED)
    else:  # through dispatch: the kernel's own configs, and the path it picks
        out, lse = portattn.attention(*leaves, mask=mask, softcap=softcap, return_lse=True,
                                      kernel="triton_flash")
    exact = [t.detach().double().requires_grad_() for t in leaves]
    want_out, want_lse = reference(*exact, mask=mask, softcap=softcap)
    gen = torch.Generator().manual_seed(7)
    dout = torch.randn(want_out.shape, generator=gen, dtype=torch.float64)
    dlse = torch.where(want_lse.isinf(), 0.0,
                       torch.randn(want_lse.shape, generator=gen, dtype=torch.float64))
    got = torch.autograd.grad([out, lse], leaves, [dout.to(out.dtype), dlse.float()])
    want = torch.autograd.grad([want_out, want_lse], exact, [dout, dlse], allow_unused=True,
                               materialize_grads=True)
    for name_, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert not torch.isnan(a).any(), f"{name_}: NaN"
        err = (a.double() - b).abs().max().item()
        limit = GRAD_TOLERANCE[dtype] * max(1.0, b.abs().max().item())
        assert err <= limit, f"{name_}: max |error| {err:.3g} > {limit:.3g}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["causal_documents", "global_window",
                                  "function_per_batch_and_head"])
def test_gradients(name, dtype):
    check(name, dtype)


@pytest.mark.parametrize("name", ["documents", "sinks_window_causal", "prefix_lm",
                                  "block_layout_per_head", "dense"])
def test_gradients_more_kinds(name):
    check(name, lq=40, lk=70)


def test_gradients_with_softcap_through_dispatch():
    check("causal_documents", hq=2, hkv=1, lq=70, lk=70, softcap=3.0, path="dispatch")


def test_decode_under_autograd():
    check("global_window", hq=8, hkv=2, lq=3, lk=80, path="dispatch")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_nan_keys_another_document_holds_reach_no_other_row(dtype):
    # Document 1's key 40 is NaN: its rows' dQ is NaN; that of documents 0 and 2, whose
    # partial tiles hold the key, is bitwise as without it.
    ids = torch.tensor([0] * 37 + [1] * 6 + [2] * 21)
    mask = masks.documents(ids)
    q, k, v = inputs(getattr(torch, dtype), (1,), 2, 2, 64, 64, 16)
    dout = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(2)).to(q.dtype)

    def gradients():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = flash_attention(*leaves, mask=mask, config=SMALL, backward_config=MIXED)
        return torch.autograd.grad(out, leaves, dout)

    clean = gradients()
    k[..., 40, :] = float("nan")
    dq = gradients()[0]
    seen = ids == 1
    assert dq[..., seen, :].isnan().all()
    assert torch.equal(dq[..., ~seen, :], clean[0][..., ~seen, :])
