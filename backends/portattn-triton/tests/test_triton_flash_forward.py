"""The direct, fixed-config path at sizes where the tile logic matters.

Small blocks (16 or 32) over sequences up to 200 give every query block a masked head,
a mask-free middle and a masked tail, so the loop bounds and the three stages are all
exercised. Results are compared with the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from portattn_triton import Config, flash_forward

from portattn import masks
from portattn.testing import assert_close, oracle

SMALL = Config(16, 16, 1, 1)
TALL = Config(32, 16, 1, 1)  # query blocks taller than key blocks
WIDE = Config(16, 32, 1, 1)


def _inputs(dtype, batch, hq, hkv, lq, lk, d, dv, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((*batch, h, n, e))
              for h, n, e in ((hq, lq, d), (hkv, lk, d), (hkv, lk, dv))]
    tensors = [torch.asarray(a).to(getattr(torch, dtype)) for a in arrays]
    return tensors, [t.double().numpy() for t in tensors]


def _oracle_mask(batch, causal, window, key_lengths, query_lengths):
    parts = []
    if causal is not None:
        parts.append(masks.causal(causal))
    if window is not None:
        parts.append(masks.sliding_window(*window))
    for make, lengths in ((masks.key_lengths, key_lengths), (masks.query_lengths, query_lengths)):
        if lengths is not None:
            parts.append(make(np.asarray(lengths, dtype=np.int64).reshape(batch)))
    mask = None
    for part in parts:
        mask = part if mask is None else mask & part
    return mask


def check(dtype="float32", batch=(1,), hq=2, hkv=2, lq=70, lk=70, d=32, dv=None, *,
          causal=None, window=None, key_lengths=None, query_lengths=None, softcap=None,
          scale=None, config=SMALL, layout=None, path=None, num_splits=None):
    dv = d if dv is None else dv
    (q, k, v), np_args = _inputs(dtype, batch, hq, hkv, lq, lk, d, dv)
    if layout is not None:
        q, k, v = (layout(t) for t in (q, k, v))
    lengths = {name: None if x is None else torch.tensor(x).reshape(batch)
               for name, x in (("key_lengths", key_lengths), ("query_lengths", query_lengths))}
    out, lse = flash_forward(q, k, v, causal=causal, window=window, softcap=softcap,
                             scale=scale, config=config, path=path, num_splits=num_splits,
                             **lengths)
    mask = _oracle_mask(batch, causal, window, key_lengths, query_lengths)
    want_out, want_lse, _ = oracle(*np_args, mask=mask, softcap=softcap, scale=scale)
    assert out.dtype == q.dtype
    assert lse.dtype == torch.float32
    assert_close(out, want_out, dtype, "out")
    assert_close(lse, want_lse, dtype, "lse")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("config", [SMALL, TALL, WIDE], ids=str)
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize(("lq", "lk"), [(100, 100), (40, 130), (130, 45)])
def test_causal(dtype, config, alignment, lq, lk):
    check(dtype, lq=lq, lk=lk, causal=alignment, config=config)


@pytest.mark.parametrize("window", [(9, 0), (20, 5), (None, 3), (6, None), (0, 0)])
@pytest.mark.parametrize(("lq", "lk"), [(90, 90), (50, 120), (110, 60)])
def test_sliding_window(window, lq, lk):
    check(lq=lq, lk=lk, window=window, config=TALL)


def test_window_and_top_left_causal():
    check(lq=60, lk=100, causal="top_left", window=(70, 10))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_lengths(dtype):
    check(dtype, batch=(3,), lq=96, lk=120, key_lengths=[120, 37, 0],
          query_lengths=[5, 96, 50], config=TALL)


def test_lengths_with_causal_and_window():
    check(batch=(2,), lq=100, lk=100, causal="bottom_right", window=(30, None),
          key_lengths=[64, 81], query_lengths=[100, 17])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(("hq", "hkv"), [(6, 2), (4, 1)])
def test_grouped_query(dtype, hq, hkv):
    check(dtype, hq=hq, hkv=hkv, lq=40, lk=75, causal="bottom_right")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_softcap(dtype):
    check(dtype, lq=50, lk=80, softcap=2.0, scale=1.0, causal="top_left")


@pytest.mark.parametrize(("d", "dv"), [(48, 48), (80, 24), (16, 128), (256, 256)])
def test_head_dims(d, dv):
    check(lq=33, lk=47, d=d, dv=dv, causal="bottom_right")


def test_leading_batch_dims_and_strided_inputs():
    # (B1, B2, L, H, D) memory viewed as (B1, B2, H, L, D): no contiguous head axis
    def layout(t):
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)

    check(batch=(2, 3), hq=2, hkv=1, lq=20, lk=36, layout=layout, causal="bottom_right")


def test_default_config_and_scale():
    check(lq=200, lk=200, d=64, causal="bottom_right", config=None, scale=0.2)


def test_empty_sequences():
    q, k, v = (torch.ones(2, 3, n, 16) for n in (4, 0, 0))
    out, lse = flash_forward(q, k, v)
    assert out.shape == (2, 3, 4, 16)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    out, lse = flash_forward(q[..., :0, :], torch.ones(2, 3, 5, 16), torch.ones(2, 3, 5, 8))
    assert out.shape == (2, 3, 0, 8)
    assert lse.shape == (2, 3, 0)


# --- fully masked tiles are never read -----------------------------------------------

def _poisoned(lq, lk, keys, **options):
    """Keys (and values) in ``keys`` are NaN; the result must match the clean inputs."""
    (q, k, v), _ = _inputs("float32", (1,), 2, 2, lq, lk, 16, 16)
    clean, _ = flash_forward(q, k, v, config=SMALL, **options)
    k[..., keys, :] = float("nan")
    v[..., keys, :] = float("nan")
    poisoned, _ = flash_forward(q, k, v, config=SMALL, **options)
    assert not torch.isnan(poisoned).any()
    assert torch.equal(poisoned, clean)


def test_skips_tiles_past_key_lengths():
    # length 40: the tile [32, 48) is read and masked, tiles from 48 on are skipped
    _poisoned(32, 96, slice(48, None), key_lengths=torch.tensor([40]))


def test_skips_tiles_above_the_causal_diagonal():
    _poisoned(32, 128, slice(32, None), causal="top_left")


def test_skips_tiles_left_of_the_window():
    # bottom-right: queries sit at 96..127 and see keys from 88 on; tiles below 80 skipped
    _poisoned(32, 128, slice(0, 80), window=(8, 0))
