"""The tensor-descriptor (TMA) forward and split-KV decode, through the interpreter.

Each path against the float64 reference at sizes that cross many tiles (small blocks),
with every mask kind; how the launcher picks a path; decode's merge over splits that
saw no key; the autotuner's candidates. The compiled code is checked in
``test_triton_compile.py``.
"""

from __future__ import annotations

import pytest
import torch
from portattn_triton import (
    Config,
    autotune_candidates,
    decode_config,
    flash_attention,
    flash_forward,
    pick_config,
    pick_path,
)
from test_triton_flash_forward import check

TMA_CONFIGS = [Config(16, 16, 1, 1), Config(32, 16, 1, 1), Config(16, 32, 1, 1, True)]
#: Decode tiles of 16 keys, so each split spans several key blocks.
DECODE = Config(16, 16, 1, 1)
DECODE_ROWS_64 = Config(64, 16, 1, 1)


# --- the tensor-descriptor forward ----------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("config", TMA_CONFIGS[1:], ids=str)
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize(("lq", "lk"), [(100, 100), (40, 130), (130, 45)])
def test_tma_causal(dtype, config, alignment, lq, lk):
    check(dtype, lq=lq, lk=lk, causal=alignment, config=config, path="tma")


@pytest.mark.parametrize("window", [(9, 0), (20, 5), (None, 3), (6, None)])
def test_tma_sliding_window(window):
    check(lq=90, lk=120, window=window, config=TMA_CONFIGS[1], path="tma")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tma_lengths_gqa_softcap(dtype):
    check(dtype, batch=(3,), hq=6, hkv=2, lq=70, lk=100, key_lengths=[100, 37, 0],
          query_lengths=[5, 70, 50], softcap=3.0, causal="bottom_right",
          config=TMA_CONFIGS[0], path="tma")


@pytest.mark.parametrize(("d", "dv"), [(24, 40), (80, 24), (256, 256)])
def test_tma_uneven_head_dims(d, dv):
    # Descriptor blocks are the padded dims: columns past D read as zeros.
    check(lq=33, lk=47, d=d, dv=dv, causal="bottom_right", config=TMA_CONFIGS[0], path="tma")


def test_tma_leading_batch_dims_and_strided_inputs():
    def layout(t):  # (B1, B2, L, H, D) memory viewed as (B1, B2, H, L, D)
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)

    check(batch=(2, 3), hq=2, hkv=1, lq=20, lk=36, layout=layout, causal="bottom_right",
          config=TMA_CONFIGS[0], path="tma")


def test_tma_rerun_is_bitwise_equal():
    q, k, v = (torch.randn(2, 4, 70, 32, dtype=torch.float16) for _ in range(3))
    first = flash_forward(q, k, v, causal="bottom_right", config=TMA_CONFIGS[0], path="tma")
    again = flash_forward(q, k, v, causal="bottom_right", config=TMA_CONFIGS[0], path="tma")
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


# --- split-KV decode -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("num_splits", [1, 7])
@pytest.mark.parametrize(("hq", "hkv", "lq"), [(8, 2, 1), (4, 1, 5), (2, 2, 16), (16, 4, 4)])
def test_decode_causal_gqa(dtype, num_splits, hq, hkv, lq):
    config = DECODE if hq // hkv * lq <= 16 else DECODE_ROWS_64
    check(dtype, hq=hq, hkv=hkv, lq=lq, lk=300, causal="bottom_right", config=config,
          path="decode", num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("mask", [
    {"causal": "top_left"},  # query i sees keys 0..i only: most splits see nothing
    {"window": (50, 0)},
    {"window": (None, 2), "causal": "bottom_right"},
    {"key_lengths": [300, 17, 0], "query_lengths": [3, 1, 3]},
])
def test_decode_masks(num_splits, mask):
    check(batch=(3,), hq=4, hkv=2, lq=3, lk=300, config=DECODE, path="decode",
          num_splits=num_splits, softcap=4.0, **mask)


@pytest.mark.parametrize(("d", "dv"), [(24, 40), (256, 256)])
def test_decode_head_dims(d, dv):
    dtype = "float16" if d == 256 else "float32"  # no float32 decode at head dim 256
    check(dtype, hq=4, hkv=2, lq=2, lk=90, d=d, dv=dv, config=DECODE, path="decode",
          num_splits=3)


def test_decode_default_config_and_splits():
    check(hq=8, hkv=2, lq=1, lk=1000, d=64, causal="bottom_right", config=None)


@pytest.mark.parametrize("path", ["pointer", "tma", "decode"])
def test_no_key_past_the_lengths_is_read(path):
    # Key length 70 in blocks of 16: the tile at 64 holds 6 keys and 10 it must not read.
    q = torch.randn(1, 4, 2, 16)
    k, v = (torch.randn(1, 2, 200, 16) for _ in range(2))
    lengths = torch.tensor([70])
    config = DECODE if path == "decode" else TMA_CONFIGS[1]
    options = {"num_splits": 5} if path == "decode" else {}
    clean = flash_forward(q, k, v, key_lengths=lengths, config=config, path=path, **options)
    k[..., 70:, :] = float("nan")
    v[..., 70:, :] = float("nan")
    poisoned = flash_forward(q, k, v, key_lengths=lengths, config=config, path=path,
                             **options)
    assert all(torch.equal(a, b) for a, b in zip(clean, poisoned, strict=True))


#: Three queries over 44 keys, bottom-right: under a window of 4 to the left, key 37 is
#: seen by row 0 only (and keys 32-36 by none, though their tile is read); under a
#: causal mask key 43 is seen by row 2 only.
BAND_CASES = {"window": ({"window": (4, 0)}, 37, 0), "causal": ({"causal": "bottom_right"},
                                                                43, 2)}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", ["pointer", "tma", "decode"])
@pytest.mark.parametrize("mask", BAND_CASES)
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_values_the_band_hides_change_nothing(path, mask, where, bad, dtype):
    # The rows that attend the bad key come out NaN, all others bitwise as without it.
    options, key, row = BAND_CASES[mask]
    q = torch.randn(1, 4, 3, 16, dtype=dtype)
    k, v = (torch.randn(1, 2, 44, 16, dtype=dtype) for _ in range(2))
    config = DECODE if path == "decode" else TMA_CONFIGS[1]
    if path == "decode":
        options = {**options, "num_splits": 2}
    clean = flash_forward(q, k, v, config=config, path=path, **options)
    (k if where == "key" else v)[..., key, :] = bad
    out, lse = flash_forward(q, k, v, config=config, path=path, **options)
    others = [i for i in range(3) if i != row]
    assert out[..., row, :].isnan().all()
    assert lse[..., row].isnan().all()
    assert torch.equal(out[..., others, :], clean[0][..., others, :])
    assert torch.equal(lse[..., others], clean[1][..., others])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", ["pointer", "tma", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_values_hidden_from_every_row_change_nothing(path, dtype):
    q = torch.randn(1, 4, 3, 16, dtype=dtype)
    k, v = (torch.randn(1, 2, 44, 16, dtype=dtype) for _ in range(2))
    config = DECODE if path == "decode" else TMA_CONFIGS[1]
    options = {"window": (4, 0), **({"num_splits": 2} if path == "decode" else {})}
    clean = flash_forward(q, k, v, config=config, path=path, **options)
    k[..., 33, :], v[..., 34, :] = float("nan"), float("inf")  # in a tile that is read
    poisoned = flash_forward(q, k, v, config=config, path=path, **options)
    assert all(torch.equal(a, b) for a, b in zip(clean, poisoned, strict=True))


# The interpreter's NumPy warns about the NaN and the overflow, as it should.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", ["pointer", "tma", "decode"])
@pytest.mark.parametrize("case", ["nan_query", "overflow"])
def test_nan_rows_stay_nan(path, case):
    # Row 1 of each head holds a NaN query or scores beyond float32: NaN out and lse
    # there, whatever the path, and the other rows as without it.
    q = torch.randn(1, 4, 3, 16)
    k, v = (torch.randn(1, 2, 200, 16) for _ in range(2))
    config = DECODE if path == "decode" else TMA_CONFIGS[1]
    options = {"num_splits": 5} if path == "decode" else {}
    clean = flash_forward(q, k, v, causal="bottom_right", config=config, path=path, **options)
    q[..., 1, :] = float("nan") if case == "nan_query" else 1e30
    if case == "overflow":
        k[..., 0, :] = 1e30  # key 0 scores +inf with row 1 (and some others)
    out, lse = flash_forward(q, k, v, causal="bottom_right", config=config, path=path,
                             **options)
    assert out[..., 1, :].isnan().all()
    assert lse[..., 1].isnan().all()
    if case == "nan_query":
        assert torch.equal(out[..., [0, 2], :], clean[0][..., [0, 2], :])


def test_decode_rerun_is_bitwise_equal():
    q = torch.randn(2, 8, 1, 32, dtype=torch.float16)
    k, v = (torch.randn(2, 2, 500, 32, dtype=torch.float16) for _ in range(2))
    first = flash_forward(q, k, v, config=DECODE, path="decode", num_splits=6)
    again = flash_forward(q, k, v, config=DECODE, path="decode", num_splits=6)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_decode_refuses_more_rows_than_a_tile():
    q = torch.randn(1, 8, 9, 16)  # 8 heads per K/V head x 9 queries = 72 rows > 64
    k = v = torch.randn(1, 1, 40, 16)
    with pytest.raises(ValueError, match="got 8 heads x 9 queries"):
        flash_forward(q, k, v, path="decode")


def test_decode_forward_under_autograd():
    # The backward needs only out and lse: the decode path serves training too.
    q = torch.randn(1, 4, 3, 16, dtype=torch.float64).float().requires_grad_()
    k, v = (torch.randn(1, 2, 80, 16).requires_grad_() for _ in range(2))
    out, _ = flash_attention(q, k, v, causal="bottom_right")
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    group = 2
    s = exact[0] @ exact[1].repeat_interleave(group, 1).transpose(-1, -2) / 4.0
    keep = torch.arange(80)[None, :] <= torch.arange(3)[:, None] + 77
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    want = torch.autograd.grad((p @ exact[2].repeat_interleave(group, 1)).sum(), exact)
    for got, w in zip(grads, want, strict=True):
        torch.testing.assert_close(got.double(), w, rtol=2e-5, atol=2e-5)


# --- choosing a path -----------------------------------------------------------------

def _tensors(hq, hkv, lq, lk, d, dtype=torch.float16):
    return (torch.empty(2, hq, lq, d, dtype=dtype), torch.empty(2, hkv, lk, d, dtype=dtype),
            torch.empty(2, hkv, lk, d, dtype=dtype))


@pytest.mark.parametrize(("shape", "capability", "want"), [
    ((32, 8, 1, 32768, 128), (9, 0), "decode"),   # GQA 32/8: 4 rows per K/V head
    ((16, 16, 16, 32768, 128), (9, 0), "decode"),
    ((16, 4, 16, 4096, 128), (9, 0), "decode"),   # 64 rows: one full tile
    ((16, 2, 16, 4096, 128), (9, 0), "tma"),      # 128 rows: the forward
    ((16, 16, 17, 4096, 128), (9, 0), "tma"),
    ((16, 16, 4096, 4096, 128), (9, 0), "tma"),
    ((16, 16, 4096, 4096, 128), (8, 0), "pointer"),
    ((16, 16, 4096, 4096, 128), None, "pointer"),  # the interpreter
    ((16, 16, 4096, 4096, 20), (9, 0), "pointer"),  # 40-byte rows: no descriptors
])
def test_pick_path(shape, capability, want):
    assert pick_path(capability, *_tensors(*shape)) == want


@pytest.mark.parametrize(("shape", "want"), [
    ((16, 2, 2, 4096, 128), "decode"),   # 16 rows: the float32 limit at head dim 128
    ((16, 2, 4, 4096, 128), "tma"),      # 32 rows
    ((16, 16, 1, 4096, 256), "pointer"),  # float32 at 256: no decode, no descriptors
    ((16, 16, 4096, 4096, 256), "pointer"),
])
def test_pick_path_float32_limits(shape, want):
    assert pick_path((9, 0), *_tensors(*shape, dtype=torch.float32)) == want


def test_pick_path_keeps_strided_views_off_descriptors():
    q, k, v = _tensors(4, 4, 64, 64, 64)
    odd = torch.empty(2, 4, 64, 65, dtype=torch.float16)[..., 1:]  # misaligned base
    assert pick_path((9, 0), odd, k, v) == "pointer"
    assert pick_path((9, 0), q, k, v) == "tma"


def test_fixed_config_without_path_is_a_forward_tile():
    assert pick_path(None, *_tensors(4, 4, 1, 64, 16), decode=False) == "pointer"
    check(hq=4, hkv=1, lq=8, lk=70, config=Config(16, 16, 1, 1))  # 32 rows, forward kernel


def test_bad_path_and_options_are_named():
    q = k = v = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="path='fast'"):
        flash_forward(q, k, v, path="fast")
    with pytest.raises(ValueError, match="config or autotune"):
        flash_forward(q, k, v, config=Config(16, 16, 1, 1), autotune=True)


# --- block sizes -----------------------------------------------------------------------

@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
@pytest.mark.parametrize("element_bytes", [2, 4])
@pytest.mark.parametrize("dim", [64, 128])
def test_autotune_candidates(capability, element_bytes, dim):
    found = autotune_candidates(capability, element_bytes, dim, dim)
    assert found[0] == pick_config(capability, element_bytes, dim, dim)
    assert len(set(found)) == len(found) > 4
    assert not any(c.warp_specialize for c in found)


@pytest.mark.parametrize(("rows", "block_m"), [(1, 16), (4, 16), (17, 32), (64, 64)])
def test_decode_config_fits_the_rows(rows, block_m):
    assert decode_config((9, 0), 2, 128, 128, rows).block_m == block_m
