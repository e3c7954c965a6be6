"""Every mask kind through the block form, on each forward path, at sizes that cross many
small tiles (interpreter; against portattn's reference kernel in float64).

Hidden tiles must never be read (NaN keys only they hold change nothing), full tiles
must run unmasked and whole, and partial tiles combine the band, the lengths and the
bit tiles; split-KV decode merges the query heads of a group into one tile.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from portattn_triton import Config, TritonFlashKernel, flash_forward

import portattn
from portattn import masks
from portattn.testing import assert_close

sys.path.insert(0, str(Path(__file__).parent))
from maskcases import MASKS, WRITES, inputs, reference

SMALL = Config(16, 16, 1, 1)
TALL = Config(32, 16, 1, 1)
DECODE = Config(16, 16, 1, 1)
DTYPES = {"float32": torch.float32, "float16": torch.float16}


def check(name, dtype="float32", path="pointer", config=SMALL, batch=(2,), hq=4, hkv=2,
          lq=70, lk=70, d=16, dv=None, num_splits=None, **options):
    q, k, v = inputs(DTYPES[dtype], batch, hq, hkv, lq, lk, d, dv)
    mask = MASKS[name](batch, hq, lq, lk) if name else options.pop("mask")
    out, lse = flash_forward(q, k, v, mask=mask, config=config, path=path,
                             num_splits=num_splits, **options)
    bias = options.get("bias")
    want_out, want_lse = reference(q, k, v, mask=mask, softcap=options.get("softcap"),
                                   bias=None if bias is None else bias.double())
    assert out.dtype == q.dtype
    assert_close(out, want_out.numpy(), dtype, "out")
    assert_close(lse, want_lse.numpy(), dtype, "lse")
    return out, lse


def test_declares_every_kind_and_a_bias():
    assert TritonFlashKernel.masks == frozenset(masks.KINDS)
    assert TritonFlashKernel.bias


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("path", ["pointer", "tma"])
def test_every_kind(name, path):
    check(name, path=path, config=SMALL if path == "pointer" else TALL)


@pytest.mark.parametrize("name", ["causal_documents", "global_window", "dense",
                                  "function_per_batch_and_head"])
def test_float16_cross_lengths_and_softcap(name):
    check(name, "float16", lq=45, lk=90, softcap=3.0, config=TALL)


@pytest.mark.parametrize("name", ["documents", "global_window", "sinks_window_causal",
                                  "block_layout_per_head", "function_per_batch_and_head",
                                  "dense", "sequence_window"])
@pytest.mark.parametrize("hq", [4, 8])
def test_decode(name, hq):
    # the query heads of a group share one tile: per-head masks merge their tiles
    check(name, path="decode", config=DECODE, hq=hq, lq=2, lk=90, num_splits=3)


def test_default_configs_through_dispatch():
    q, k, v = inputs(torch.float32, (2,), 4, 4, 200, 200, 64)
    mask = MASKS["causal_documents"]((2,), 4, 200, 200)
    assert portattn.explain(q, k, v, mask=mask).kernel.name == "triton_flash"
    out, lse = portattn.attention(q, k, v, mask=mask, return_lse=True, kernel="triton_flash")
    want_out, want_lse = reference(q, k, v, mask=mask)
    assert_close(out, want_out.numpy(), "float32", "out")
    assert_close(lse, want_lse.numpy(), "float32", "lse")


# --- hidden tiles are never read, full tiles never masked -------------------------------

#: Three documents of 32 in tiles of 16: every tile is hidden or full.
ALIGNED = torch.tensor([0] * 32 + [1] * 32 + [2] * 32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", ["pointer", "tma", "decode"])
@pytest.mark.parametrize("where", ["key", "value"])
def test_keys_only_hidden_tiles_hold_change_nothing(path, where):
    # Document 2's keys are NaN: rows of documents 0 and 1 see them only in hidden
    # tiles, which must not be read (as a full tile, they would make those rows NaN).
    lq = 2 if path == "decode" else 96
    q_ids = ALIGNED[-lq:] * 0 if path == "decode" else ALIGNED  # decode: two rows of doc 0
    mask = masks.documents(q_ids, ALIGNED)
    q, k, v = inputs(torch.float32, (1,), 2, 2, lq, 96, 16)
    options = {"config": DECODE if path == "decode" else SMALL, "path": path,
               "num_splits": 3 if path == "decode" else None}
    clean = flash_forward(q, k, v, mask=mask, **options)
    (k if where == "key" else v)[..., 64:, :] = float("nan")
    out, lse = flash_forward(q, k, v, mask=mask, **options)
    seen = q_ids == 2
    assert torch.equal(out[..., ~seen, :], clean[0][..., ~seen, :])
    assert torch.equal(lse[..., ~seen], clean[1][..., ~seen])
    assert out[..., seen, :].isnan().all()


def test_aligned_documents_are_full_tiles_only():
    from portattn_triton._plan import plan_for

    q = torch.empty(1, 2, 96, 16)
    grid = plan_for(q, q, mask=masks.documents(ALIGNED)).grid(16, 16)
    table = grid.rows[0]
    assert not grid.has_bits
    assert table[..., 0].eq(0).all()  # no partial tile
    assert table[..., 1].eq(2).all()  # two full tiles per query block


def test_full_tiles_unmasked_and_partial_tiles_masked():
    # Full tiles inside a document, partial ones across its edges, and a causal band:
    # a full tile masked by a stray bit tile, or a partial one read unmasked, changes
    # the answer.
    ids = torch.tensor([0] * 40 + [1] * 24 + [2] * 32)
    check(None, mask=masks.documents(ids) & masks.causal(), lq=96, lk=96, batch=(1,))
    check(None, mask=masks.documents(ids) | masks.sliding_window(3, 3), lq=96, lk=96,
          batch=(1,))


def test_masked_everywhere_gives_zero_and_minus_inf():
    ids = torch.tensor([0] * 30 + [-1] * 40)
    out, lse = check(None, mask=masks.documents(ids), batch=(1,))
    assert torch.equal(out[..., 30:, :], torch.zeros_like(out[..., 30:, :]))
    assert torch.isneginf(lse[..., 30:]).all()


@pytest.mark.parametrize("path", ["pointer", "decode"])
def test_one_mask_over_many_calls_follows_its_tensors(path):
    # tables and bit tiles are shared across calls while the tensors are unchanged
    lq = 70 if path == "pointer" else 3
    ids = torch.arange(70) // 9
    mask = masks.causal() & masks.documents(ids[70 - lq:], ids)  # the last lq queries
    check(None, path=path, lq=lq, mask=mask)
    check(None, path=path, lq=lq, mask=mask)
    ids[:] = torch.arange(70) // 25  # changed in place: new tables
    check(None, path=path, lq=lq, mask=mask)


@pytest.mark.parametrize("route", sorted(WRITES))
def test_ids_written_before_the_backward_or_the_next_call(route):
    # the backward uses the mask its forward used; the next call the values it meets
    old, new = torch.arange(48) // 20, torch.arange(48) // 7
    ids = old.clone()
    q, k, v = (x.requires_grad_(True) for x in inputs(torch.float32, (1,), 2, 1, 48, 48, 16))
    out = portattn.attention(q, k, v, mask=masks.documents(ids) & masks.causal(),
                             kernel="triton_flash")
    WRITES[route](ids, new.numpy())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want, _ = reference(q, k, v, mask=masks.documents(old) & masks.causal())
    wanted = torch.autograd.grad(want.sum(), (q, k, v))
    assert_close(out.detach(), want.detach().numpy(), "float32")
    for name, got, expected in zip("qkv", grads, wanted, strict=True):
        assert_close(got, expected.numpy(), "float32", f"d{name}")
    again = portattn.attention(q, k, v, mask=masks.documents(ids) & masks.causal(),
                               kernel="triton_flash")
    want_new, _ = reference(q, k, v, mask=masks.documents(new) & masks.causal())
    assert_close(again.detach(), want_new.detach().numpy(), "float32")
