"""Semantics shared by every backend: merge, dtypes, torch-compatible wrapper."""

from __future__ import annotations

import math

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.testing import assert_close, oracle, to_numpy
from portattn.testing.plugin import require_library


def make(backend, shapes, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    return tuple(backend.asarray(rng.standard_normal(s), dtype) for s in shapes)


@pytest.mark.parametrize("mask", [None, "causal", "window_and_lengths"])
def test_merge_of_key_blocks_is_exact(backend, mask):
    xp = backend.xp
    q, k, v = make(backend, [(2, 4, 12, 8), (2, 2, 30, 8), (2, 2, 30, 8)], "float64")
    lq, lk = 12, 30
    full = {"causal": masks.causal(),
            "window_and_lengths": masks.sliding_window(5, 2) & masks.key_lengths(
                backend.asarray(np.array([30, 9])))}.get(mask)
    want_out, want_lse = portattn.attention(q, k, v, mask=full, return_lse=True)
    outs, lses = [], []
    for k0, k1 in [(0, 7), (7, 20), (20, 30)]:
        part = None if full is None else full.restrict(xp, 0, lq, k0, k1, lq, lk)
        out, lse = portattn.attention(q, k[..., k0:k1, :], v[..., k0:k1, :], mask=part,
                                      return_lse=True)
        outs.append(out)
        lses.append(lse)
    out, lse = portattn.merge(outs, lses)
    assert_close(out, to_numpy(want_out), "float64", "merged out")
    np.testing.assert_allclose(to_numpy(lse), to_numpy(want_lse), rtol=1e-12)


def test_merge_keeps_empty_rows_empty(backend):
    xp = backend.xp
    out = backend.asarray(np.zeros((1, 3, 2)), "float32")
    lse = backend.asarray(np.full((1, 3), -math.inf), "float32")
    merged, merged_lse = portattn.merge([out, out], [lse, lse])
    assert not np.isnan(to_numpy(merged)).any()
    assert np.isneginf(to_numpy(merged_lse)).all()
    assert merged.dtype == xp.float32


def test_merge_rejects_mismatched_parts():
    with pytest.raises(ValueError, match="one lse per output"):
        portattn.merge([np.zeros((1, 2, 3))], [])
    with pytest.raises(ValueError, match=r"outputs\[1\].shape=\(1, 4, 3\)"):
        portattn.merge([np.zeros((1, 2, 3)), np.zeros((1, 4, 3))],
                       [np.zeros((1, 2)), np.zeros((1, 4))])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_output_and_lse_dtypes(backend, dtype):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    q, k, v = make(backend, [(1, 2, 5, 8)] * 3, dtype)
    out, lse = portattn.attention(q, k, v, return_lse=True)
    assert str(out.dtype).endswith(dtype)
    lse_dtype = "float32" if dtype in ("float16", "bfloat16") else dtype
    assert str(lse.dtype).endswith(lse_dtype)


def test_fully_masked_everything_is_zero_not_nan(backend):
    q, k, v = make(backend, [(2, 2, 6, 8)] * 3)
    lengths = backend.asarray(np.array([0, 0]))
    out, lse = portattn.attention(q, k, v, mask=masks.key_lengths(lengths), return_lse=True)
    np.testing.assert_array_equal(to_numpy(out), 0)
    assert np.isneginf(to_numpy(lse)).all()


@pytest.mark.parametrize("kernel", ["tiled", "reference"])
def test_a_bias_at_the_lowest_value_is_a_score_not_a_mask(backend, kernel):
    # An additive mask of the dtype's lowest value (transformers' convention) over every
    # key a structured mask allows: those keys share the row evenly, as in torch's SDPA,
    # and the keys the mask hides stay out.
    q, k, v = make(backend, [(1, 2, 6, 8)] * 3, "float32")
    lowest = float(np.finfo(np.float32).min)
    bias = np.zeros((6, 6), np.float32)
    bias[2, :] = lowest
    out = portattn.attention(q, k, v, mask=masks.causal(), kernel=kernel,
                             bias=backend.asarray(bias, "float32"))
    want = to_numpy(v)[..., :3, :].mean(axis=-2)  # row 2 sees keys 0..2, all at the bias
    np.testing.assert_allclose(to_numpy(out)[..., 2, :], want, rtol=1e-5, atol=1e-6)
    assert np.isfinite(to_numpy(out)).all()


SDPA_CASES = {
    "plain": {},
    "is_causal": {"is_causal": True},
    "bool_mask": {"attn_mask": "bool"},
    "float_mask": {"attn_mask": "float"},
    "scale": {"scale": 0.7},
    "gqa": {"enable_gqa": True},
}


@pytest.mark.cross  # two libraries: runs in the cross tox env (numpy + torch)
@pytest.mark.parametrize("name", list(SDPA_CASES))
def test_sdpa_wrapper_matches_torch(backend, name):
    torch = require_library("torch")
    options = dict(SDPA_CASES[name])
    hkv = 2 if options.get("enable_gqa") else 4
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s) for s in ((2, 4, 7, 8), (2, hkv, 11, 8), (2, hkv, 11, 8))]
    torch_options = dict(options)
    if options.get("attn_mask") == "bool":
        mask = rng.random((7, 11)) < 0.6
        mask[:, 0] = True  # torch's SDPA returns NaN for fully masked rows
        options["attn_mask"] = backend.asarray(mask)
        torch_options["attn_mask"] = torch.asarray(mask)
    elif options.get("attn_mask") == "float":
        bias = rng.standard_normal((4, 7, 11))
        options["attn_mask"] = backend.asarray(bias, "float64")
        torch_options["attn_mask"] = torch.asarray(bias)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.asarray(a) for a in arrays), **torch_options)
    got = portattn.scaled_dot_product_attention(
        *(backend.asarray(a, "float64") for a in arrays), **options)
    assert_close(got, want.numpy(), "float64")


def test_sdpa_combines_mask_and_causal():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    allowed = rng.random((6, 6)) < 0.7
    got = portattn.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=True)
    want, _, _ = oracle(q, k, v, mask=masks.dense(allowed) & masks.causal("top_left"))
    assert_close(got, want, "float64")


@pytest.mark.parametrize("variant", ["causal_upper_left", "causal_lower_right"])
def test_sdpa_wrapper_takes_torchs_causal_bias(variant):
    # torch.nn.attention.bias: SDPA takes them as attn_mask, and so does the wrapper.
    torch = pytest.importorskip("torch")
    from torch.nn.attention import bias

    rng = np.random.default_rng(3)
    q, k, v = (torch.asarray(rng.standard_normal(s)) for s in ((2, 4, 7, 8), (2, 4, 11, 8),
                                                              (2, 4, 11, 8)))
    causal = getattr(bias, variant)(7, 11)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    got = portattn.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    assert_close(got, want.numpy(), "float64")
    with pytest.raises(ValueError, match="CausalBias, a causal mask already"):
        portattn.scaled_dot_product_attention(q, k, v, attn_mask=causal, is_causal=True)
    with pytest.raises(ValueError, match=r"CausalBias for \(Lq, Lk\) = \(7, 11\); the call "
                                         r"has \(7, 10\)"):
        portattn.scaled_dot_product_attention(q, k[..., 1:, :], v[..., 1:, :], attn_mask=causal)
