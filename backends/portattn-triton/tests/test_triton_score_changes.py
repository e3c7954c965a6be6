"""Score changes by distance on ``triton_flash`` (T5's relative positions, both ways;
learned ALiBi slopes; their sum): outputs and gradients, the tables' included, against
the portable ``tiled`` kernel in float64, under no mask, a causal mask and a sliding
window; the gradients bitwise the same on every run; and the kinds that do not follow
the distance refused by name (dispatch then runs ``tiled``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from portattn_triton import (
    BackwardConfig,
    Config,
    TritonFlashKernel,
    flash_attention,
    flash_forward,
)

import portattn
from portattn import masks, scores
from portattn.kernel import describe
from portattn.testing import assert_close

sys.path.insert(0, str(Path(__file__).parent))
from maskcases import inputs
from textbook import GRAD_TOLERANCE

HQ, HKV = 4, 2

#: name -> change of the tables (``buckets (16, HQ)``, ``slopes (HQ,)``)
CHANGES = {
    "t5": lambda t: scores.relative_position(t["buckets"], bidirectional=True,
                                             max_distance=24),
    "t5_decoder": lambda t: scores.relative_position(t["buckets"], bidirectional=False,
                                                     max_distance=24),
    "alibi": lambda t: scores.alibi(t["slopes"]),
    "sum": lambda t: scores.relative_position(t["buckets"], max_distance=24)
    + scores.alibi(t["slopes"]),
}
MASKS = {"none": None, "causal": masks.causal(), "window": masks.sliding_window(9, 4)}
#: Each kind under each mask in float32, and each kind once in float16.
CASES = [(kind, mask, "float32") for kind in CHANGES for mask in MASKS] + [
    (kind, mask, "float16") for kind, mask in zip(CHANGES, ("causal", "none", "window",
                                                            "causal"), strict=True)]


def _tables(dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    return {"buckets": torch.randn(16, HQ, generator=gen, dtype=torch.float64).to(dtype),
            "slopes": torch.rand(HQ, generator=gen, dtype=torch.float64).to(dtype) * 0.3}


def _run(kind, mask, q, k, v, tables, kernel):
    """``(out, lse, grads of q, k, v and each table)`` of one call through dispatch."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    learned = {n: t.clone().requires_grad_() for n, t in tables.items()}
    change = CHANGES[kind](learned)
    out, lse = portattn.attention(*leaves, mask=MASKS[mask], score_mod=change,
                                  return_lse=True, kernel=kernel)
    gen = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    used = [learned[n] for n in learned if any(a is learned[n] for a in change.arrays)]
    grads = torch.autograd.grad(out, leaves + used, dout)
    return out.detach(), lse.detach(), grads


def _assert_grads_close(got, want, dtype):
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, n
        err = (a.double() - b).abs().max().item()
        limit = GRAD_TOLERANCE[dtype] * max(1.0, b.abs().max().item())
        assert err <= limit, f"gradient {n}: max |error| {err:.3g} > {limit:.3g}"


@pytest.mark.parametrize(("kind", "mask", "dtype"), CASES)
def test_matches_tiled(kind, mask, dtype):
    q, k, v = inputs(getattr(torch, dtype), (1,), HQ, HKV, 37, 45, 16)
    tables = _tables()
    out, lse, grads = _run(kind, mask, q, k, v, tables, "triton_flash")
    exact = {n: t.double() for n, t in tables.items()}
    want_out, want_lse, want_grads = _run(kind, mask, q.double(), k.double(), v.double(),
                                          exact, "tiled")
    assert_close(out, want_out.numpy(), dtype, "out")
    assert_close(lse, want_lse.numpy(), dtype, "lse")
    _assert_grads_close(grads, want_grads, dtype)
    if (kind, mask, dtype) == ("sum", "causal", "float16"):  # fixed order: the same bits
        again = _run(kind, mask, q, k, v, tables, "triton_flash")[2]
        assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


#: dQ tiles wider than tall and taller than wide: the dQ pass sums a tile's diagonals
#: by rotating its longer side
TILES = {"dq_wide": BackwardConfig(Config(32, 16, 1, 1), Config(16, 32, 1, 1)),
         "dq_tall": BackwardConfig(Config(16, 32, 1, 1), Config(32, 16, 1, 1))}


@pytest.mark.parametrize("tiles", sorted(TILES))
def test_table_gradient_on_either_tile_shape(tiles):
    q, k, v = inputs(torch.float32, (1,), HQ, HKV, 41, 29, 16)
    tables = {n: t.requires_grad_() for n, t in _tables().items()}
    out, _ = flash_attention(q, k, v, causal="bottom_right", score_mod=CHANGES["sum"](tables),
                             config=Config(32, 32, 1, 1), backward_config=TILES[tiles])
    runs = [torch.autograd.grad(out.sum(), list(tables.values()), retain_graph=True)
            for _ in range(2)]
    exact = {n: t.detach().double().requires_grad_() for n, t in tables.items()}
    want = portattn.attention(q.double(), k.double(), v.double(), mask=masks.causal(),
                              score_mod=CHANGES["sum"](exact), kernel="tiled")
    _assert_grads_close(runs[0], torch.autograd.grad(want.sum(), list(exact.values())),
                        "float32")
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("path", ["tma", "decode"])
def test_other_forward_paths(path):
    lq = 3 if path == "decode" else 37
    q, k, v = inputs(torch.float32, (1,), HQ, HKV, lq, 45, 16)
    change = CHANGES["sum"](_tables())
    out, lse = flash_forward(q, k, v, score_mod=change, window=(20, 0), path=path,
                             config=Config(16, 16, 1, 1),
                             num_splits=2 if path == "decode" else None)
    exact = CHANGES["sum"]({n: t.double() for n, t in _tables().items()})
    want_out, want_lse = portattn.attention(
        q.double(), k.double(), v.double(), mask=masks.sliding_window(20, 0),
        score_mod=exact, return_lse=True, kernel="tiled")
    assert_close(out, want_out.numpy(), "float32", "out")
    assert_close(lse, want_lse.numpy(), "float32", "lse")


@pytest.mark.parametrize("kind", ["pair_table", "window_table", "t5_and_pairs"])
def test_kinds_not_by_distance_are_refused(kind):
    q, k, v = inputs(torch.float32, (2,), HQ, HKV, 4, 4, 16)
    classes = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]])
    pairs = scores.pair_table(torch.zeros(2, 2, HQ), classes, classes)
    change = {"pair_table": pairs,
              "window_table": scores.window_table(torch.zeros(9, HQ), (2, 2)),
              "t5_and_pairs": CHANGES["t5"](_tables()) + pairs}[kind]
    reasons = TritonFlashKernel.not_supported_reasons(describe(q, k, v, score_mod=change))
    assert any("not supported (supported: alibi, relative_position)" in r
               for r in reasons), reasons
    assert portattn.explain(q, k, v, score_mod=change).kernel.name == "tiled"
    with pytest.raises(ValueError, match="the kernels take changes by distance"):
        flash_forward(q, k, v, score_mod=change)


def test_empty_call_gives_zero_table_gradients():
    q, k, v = (torch.zeros(1, HQ, 0, 16), torch.zeros(1, HKV, 5, 16),
               torch.zeros(1, HKV, 5, 16))
    tables = {n: t.requires_grad_() for n, t in _tables().items()}
    out, lse = flash_attention(q, k, v, score_mod=CHANGES["sum"](tables))
    grads = torch.autograd.grad((out.sum(), lse.sum()), list(tables.values()),
                                allow_unused=True)
    assert all(g is not None and not g.any() for g in grads)


def test_tiles_wider_than_the_padding_are_refused():
    q, k, v = inputs(torch.float32, (1,), HQ, HKV, 8, 8, 16)
    with pytest.raises(ValueError, match="tiles of at most 256"):
        flash_forward(q, k, v, score_mod=CHANGES["alibi"](_tables()),
                      config=Config(512, 16, 1, 1))


def test_float32_gradients_past_head_dim_64_are_refused():
    # no registers left in the dQ pass for the diagonal sums: dispatch runs tiled
    q, k, v = (t.requires_grad_() for t in inputs(torch.float32, (1,), HQ, HKV, 8, 8, 128))
    change = CHANGES["t5"](_tables())
    reasons = TritonFlashKernel.not_supported_reasons(describe(q, k, v, score_mod=change))
    assert reasons == ["gradients with dtype=float32, head_dim=128 > 64 and a score change "
                       "not supported"]
    with torch.no_grad():
        assert not TritonFlashKernel.not_supported_reasons(describe(q, k, v, score_mod=change))
