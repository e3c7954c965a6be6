"""Gradients of the Triton kernels against float64 torch autograd of the textbook formula.

Through the interpreter (``conftest.py``), with small blocks so that every key block
has masked edges and a mask-free middle of query blocks (and every query block of key
blocks). ``gradcheck`` needs float64, which the kernel does not run, so the gradients
are compared with the float64 oracle's within tolerances keyed by dtype.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from portattn_triton import BackwardConfig, Config, flash_attention, flash_backward

sys.path.insert(0, str(Path(__file__).parent))
from textbook import GRAD_TOLERANCE, textbook

SMALL = BackwardConfig(Config(16, 16, 1, 1), Config(16, 16, 1, 1))
#: dK/dV over key blocks taller than query blocks, dQ the other way round.
MIXED = BackwardConfig(Config(16, 32, 1, 1), Config(32, 16, 1, 1))
FWD = Config(16, 16, 1, 1)


def _band(lq, lk, causal, window):
    shift = lk - lq
    lower = upper = None
    if causal is not None:
        upper = shift if causal == "bottom_right" else 0
    if window is not None:
        left, right = window
        lower = None if left is None else shift - left
        if right is not None:
            upper = shift + right if upper is None else min(upper, shift + right)
    return lower, upper


def _data(dtype, batch, hq, hkv, lq, lk, d, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((hq, lq, d), (hkv, lk, d), (hkv, lk, dv), (hq, lq, dv), (hq, lq))
    q, k, v, dout, dlse = (torch.randn(*batch, *s, generator=gen, dtype=torch.float64)
                           for s in shapes)
    q, k, v = (t.to(getattr(torch, dtype)) for t in (q, k, v))
    return q, k, v, dout, dlse


def check(dtype="float32", batch=(2,), hq=2, hkv=2, lq=70, lk=70, d=32, dv=None, *,
          causal=None, window=None, key_lengths=None, query_lengths=None, softcap=None,
          scale=None, config=SMALL, lse_grad=True, out_grad=True):
    dv = d if dv is None else dv
    q, k, v, dout, dlse = _data(dtype, batch, hq, hkv, lq, lk, d, dv)
    kl = None if key_lengths is None else torch.tensor(key_lengths).reshape(batch)
    ql = None if query_lengths is None else torch.tensor(query_lengths).reshape(batch)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, scale=scale, softcap=softcap, causal=causal,
                               window=window, key_lengths=kl, query_lengths=ql,
                               config=FWD, backward_config=config)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    lower, upper = _band(lq, lk, causal, window)
    want_out, want_lse = textbook(*exact, 1 / math.sqrt(d) if scale is None else scale,
                                  lower, upper, softcap, kl, ql)
    dlse = torch.where(torch.isinf(want_lse), 0.0, dlse)  # lse = -inf: no gradient
    outputs = [(out, want_out, dout)] if out_grad else []
    outputs += [(lse, want_lse, dlse)] if lse_grad else []
    got = torch.autograd.grad([o for o, _, _ in outputs], leaves,
                              [g.to(o.dtype) for o, _, g in outputs])
    want = torch.autograd.grad([w for _, w, _ in outputs], exact, [g for _, _, g in outputs],
                               allow_unused=True, materialize_grads=True)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == q.dtype, name
        assert not torch.isnan(a).any(), f"{name}: NaN"
        err = (a.double() - b).abs().max().item()
        limit = GRAD_TOLERANCE[dtype] * max(1.0, b.abs().max().item())
        assert err <= limit, f"{name}: max |error| {err:.3g} > {limit:.3g}"
    return got, want


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize(("lq", "lk"), [(40, 90), (90, 37)])
def test_causal(dtype, alignment, lq, lk):
    check(dtype, lq=lq, lk=lk, causal=alignment)


@pytest.mark.parametrize("window", [(9, 0), (20, 5), (None, 3), (6, None)])
def test_sliding_window(window):
    check(lq=50, lk=80, window=window, config=MIXED)


def test_no_mask_mixed_blocks():
    check(lq=70, lk=50, config=MIXED)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_lengths_and_fully_masked_rows(dtype):
    (dq, dk, dv), _ = check(dtype, batch=(3,), lq=50, lk=60, causal="bottom_right",
                            key_lengths=[60, 23, 0], query_lengths=[5, 50, 33],
                            config=MIXED)
    assert torch.equal(dq[0, :, 5:], torch.zeros_like(dq[0, :, 5:]))  # query padding
    assert torch.equal(dk[1, :, 23:], torch.zeros_like(dk[1, :, 23:]))  # key padding
    assert torch.equal(dv[2], torch.zeros_like(dv[2]))  # no key at all


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(("hq", "hkv"), [(6, 2), (3, 1)])
def test_grouped_query(dtype, hq, hkv):
    check(dtype, batch=(1,), hq=hq, hkv=hkv, lq=40, lk=55, causal="bottom_right")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_softcap_and_scale(dtype):
    check(dtype, lq=40, lk=60, softcap=2.0, scale=0.5, window=(30, 4))


@pytest.mark.parametrize(("d", "dv"), [(48, 48), (40, 24), (16, 64)])
def test_head_dims(d, dv):
    check(batch=(1,), lq=33, lk=47, d=d, dv=dv, causal="top_left")


@pytest.mark.parametrize(("out_grad", "lse_grad"), [(False, True), (True, False)])
def test_gradient_of_one_output(out_grad, lse_grad):
    check(batch=(1,), lq=30, lk=40, causal="bottom_right", out_grad=out_grad,
          lse_grad=lse_grad)


def test_leading_batch_dims():
    check(batch=(2, 2), hq=2, hkv=1, lq=20, lk=36, window=(10, None))


def test_deterministic():
    q, k, v, dout, dlse = _data("float32", (1,), 4, 2, 70, 90, 32, 32)
    out, lse = flash_attention(q, k, v, causal="bottom_right", config=FWD)
    runs = [flash_backward(q, k, v, out, lse, dout.float(), dlse.float(),
                           causal="bottom_right", config=MIXED) for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_empty_sequences():
    q, k, v = (torch.ones(2, 3, n, 16, requires_grad=True) for n in (4, 0, 0))
    out, lse = flash_attention(q, k, v)
    (out.sum() + lse.where(lse.isfinite(), 0.0).sum()).backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    assert k.grad.shape == k.shape


def test_nothing_past_the_lengths_is_read():
    # Key length 51, query length 30, in blocks of 16: tiles from 64 on are skipped,
    # and what lies past the lengths inside the visited tiles counts for nothing.
    q, k, v, dout, dlse = _data("float32", (1,), 2, 2, 96, 96, 16, 16)
    lengths = {"key_lengths": torch.tensor([51]), "query_lengths": torch.tensor([30])}
    out, lse = flash_attention(q, k, v, config=FWD, **lengths)
    dlse = torch.where(torch.isinf(lse), 0.0, dlse.float())
    clean = flash_backward(q, k, v, out, lse, dout.float(), dlse, config=SMALL, **lengths)
    for t in (k, v):
        t[..., 51:, :] = float("nan")
    for t in (q, out, dout):
        t[..., 30:, :] = float("nan")
    poisoned = flash_backward(q, k, v, out, lse, dout.float(), dlse, config=SMALL,
                              **lengths)
    for a, b in zip(clean, poisoned, strict=True):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(("options", "bad", "row"), [
    ({"window": (4, 0)}, [37], 0),  # key 37 is seen by row 0 only
    ({"causal": "bottom_right"}, [43], 2),  # key 43 by row 2 only
    ({"window": (4, 0)}, [33, 34], None),  # seen by no row, in a tile that is read
], ids=["window", "causal", "unseen"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_values_the_band_hides_reach_no_other_row(options, bad, row, dtype):
    # Three queries over 44 keys in tiles of 16. The rows that attend a bad key have
    # NaN gradients (their lse is NaN); the others' dQ is bitwise as without it.
    q, k, v, dout, dlse = _data(dtype, (1,), 4, 2, 3, 44, 16, 16)
    dout, dlse = dout.float(), dlse.float()

    def gradients():
        out, lse = flash_attention(q, k, v, config=FWD, **options)
        return flash_backward(q, k, v, out, lse, dout, dlse, config=SMALL, **options)

    clean = gradients()
    k[..., bad[0], :] = float("nan")
    v[..., bad[-1], :] = float("inf")
    poisoned = gradients()
    if row is None:
        assert all(torch.equal(a, b) for a, b in zip(clean, poisoned, strict=True))
        return
    others = [i for i in range(3) if i != row]
    assert poisoned[0][..., row, :].isnan().all()
    assert torch.equal(poisoned[0][..., others, :], clean[0][..., others, :])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_an_infinite_key_under_softcap_gives_nan_gradients_to_its_rows():
    # tanh saturates: row 0's output stays finite, but d/dq of softcap * tanh(q . k)
    # meets 0 * inf, so the chain rule gives NaN there; row 0 alone sees key 37.
    q, k, v, dout, dlse = _data("float32", (1,), 2, 2, 3, 44, 16, 16)
    options = {"window": (4, 0), "softcap": 5.0}
    k[..., 37, 0] = float("inf")
    out, lse = flash_attention(q, k, v, config=FWD, **options)
    assert out.isfinite().all()
    dq = flash_backward(q, k, v, out, lse, dout.float(), dlse.float(), config=SMALL,
                        **options)[0]
    assert dq[..., 0, :].isnan().all()
    assert dq[..., 1:, :].isfinite().all()
