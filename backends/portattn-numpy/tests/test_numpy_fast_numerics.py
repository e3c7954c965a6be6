"""What the conformance kit does not reach: range fallbacks, layouts, threads."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_numpy import configured

from portattn import attention, masks
from portattn.testing import assert_close, oracle

DTYPES = ["float32", "float64"]


def _qkv(rng, dtype, shape_q=(2, 4, 37, 16), shape_k=(2, 2, 53, 16), dv=16):
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal((*shape_k[:-1], dv)).astype(dtype)
    return q, k, v


def _check(dtype, q, k, v, **kwargs):
    out, lse = attention(q, k, v, return_lse=True, kernel="numpy_fast", **kwargs)
    wide = {n: (a.astype(np.float64) if n == "bias" else a) for n, a in kwargs.items()}
    want_out, want_lse, _ = oracle(*(a.astype(np.float64) for a in (q, k, v)),
                                   return_lse=True, **wide)
    assert out.dtype == lse.dtype == np.dtype(dtype)
    assert_close(out, want_out, dtype, "out")
    assert_close(lse, want_lse, dtype, "lse")
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_past_exp_range(dtype, path, exponential, tiny_tiles):
    # exp(scores) overflows: the fast way must notice and redo the tile carefully
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, dtype)
    _check(dtype, q, k, v, scale=400.0, mask=masks.causal())


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_far_below_zero(dtype, path, tiny_tiles):
    # every exp(score) underflows unless the row maximum is subtracted; the offset is
    # as small as does that, so float32 rounding of the sum stays within tolerance
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, dtype)
    offset = -120.0 if dtype == "float32" else -800.0
    bias = (offset + rng.standard_normal((37, 53))).astype(dtype)
    _check(dtype, q, k, v, bias=bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_with_no_keys_stay_zero(dtype, path, tiny_tiles):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, dtype)
    allowed = rng.random((2, 4, 37, 53)) < 0.3
    allowed[:, :, 5:9] = False
    out, lse = _check(dtype, q, k, v, mask=masks.dense(allowed))
    assert not out[:, :, 5:9].any()
    assert np.isneginf(lse[:, :, 5:9]).all()


def test_strided_inputs():
    rng = np.random.default_rng(4)
    # (batch, length, heads, dim) memory viewed as (batch, heads, length, dim)
    q = rng.standard_normal((2, 37, 4, 16)).astype(np.float32).transpose(0, 2, 1, 3)
    k = rng.standard_normal((2, 53, 2, 16)).astype(np.float32).transpose(0, 2, 1, 3)
    v = np.asfortranarray(rng.standard_normal((2, 2, 53, 16)).astype(np.float32))
    _check("float32", q, k, v, mask=masks.causal())
    _check("float32", q, k[..., ::2, :], v[..., ::2, :])


def test_threads_do_not_change_the_result(threads, tiny_tiles):
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, "float32")
    mask = masks.sliding_window(7, 3) & masks.key_lengths(np.array([50, 21]))
    threads(1)
    one = attention(q, k, v, mask=mask, return_lse=True, kernel="numpy_fast")
    threads(4)
    four = attention(q, k, v, mask=mask, return_lse=True, kernel="numpy_fast")
    for a, b in zip(one, four, strict=True):
        np.testing.assert_array_equal(a, b)


def test_long_keys_use_several_blocks(tiles):
    # default tile sizes: 3000 keys do not fit one key block (in tiles: without Numba's
    # compiled blocks, one head this small would be stacked, whole)
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, "float32", (1, 1, 40, 32), (1, 1, 3000, 32), dv=8)
    with configured(strategies=("tiles",)):
        _check("float32", q, k, v, mask=masks.causal())
    assert len({(k0, k1) for *_, k0, k1 in tiles}) > 1


@pytest.mark.parametrize(("q_len", "mask", "reads"), [
    (37, None, False),                                    # every row sees every key
    (1, masks.causal(), False),                           # a decode step sees them all
    (37, masks.causal(), True),                           # a causal mask hides keys
    (37, masks.key_lengths(np.array([50, 21])), True),    # so does padding
])
def test_the_values_are_read_for_non_finite_entries_only_when_a_key_can_be_hidden(
        monkeypatch, q_len, mask, reads):
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, "float32", (2, 4, q_len, 16))
    checked = []
    real = np.isfinite
    monkeypatch.setattr(np, "isfinite", lambda a, *args, **kw: checked.append(np.shape(a))
                        or real(a, *args, **kw))
    _check("float32", q, k, v, mask=mask)
    assert (v.shape in checked) is reads


@pytest.mark.parametrize(("q_len", "applied"), [
    (1, False),   # a decode step: the causal mask hides no key
    (37, True),
])
def test_a_mask_that_hides_nothing_is_not_applied(monkeypatch, q_len, applied):
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, "float32", (2, 4, q_len, 16))
    mask = masks.causal()
    with monkeypatch.context() as patch:
        tiles = []
        real = type(mask).tile
        patch.setattr(type(mask), "tile", lambda self, *args, **kw: tiles.append(args)
                      or real(self, *args, **kw))
        out = attention(q, k, v, mask=mask, kernel="numpy_fast")
    assert bool(tiles) is applied
    assert_close(out, oracle(*(a.astype(np.float64) for a in (q, k, v)), mask=mask)[0],
                 "float32", "out")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(("q_len", "mask"), [(37, None), (1, masks.causal())])
def test_a_non_finite_value_every_row_sees_reaches_every_row(bad, q_len, mask):
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, "float32", (2, 4, q_len, 16))
    v[1, 0, 11] = bad  # value row 11 of batch 1, key/value head 0 (query heads 0 and 1)
    out = attention(q, k, v, kernel="numpy_fast", mask=mask)
    assert not np.isfinite(out[1, :2]).any()
    clean = v.copy()
    clean[1, 0, 11] = 0
    want = _check("float32", q, k, clean, mask=mask)[0]
    # the other rows as without it (within rounding: its unit may be redone carefully)
    assert_close(out[0], want[0], "float32", "out")
    assert_close(out[1, 2:], want[1, 2:], "float32", "out")
