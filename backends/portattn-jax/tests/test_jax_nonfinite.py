"""Hidden non-finite keys and values in ``jax_dpa``, on the XLA path here.

Both of its paths (XLA, and cuDNN, which runs only on CUDA GPUs) zero the key rows
that are not finite and make the rows that see one NaN, in the same code before and
after the call; without it either would let a hidden NaN through ``0 * NaN``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from portattn_jax._compute import Plan, attend  # noqa: E402
from portattn_jax._translate import Band  # noqa: E402

import portattn  # noqa: E402
from portattn import masks  # noqa: E402

NAN, INF = float("nan"), float("inf")

#: ``name: (Hq, Hkv, band, key lengths, mask, spoil(k, v), rows that must be NaN)``;
#: 12 queries and keys, batch of 2; rows are ``(batch, query rows)`` index tuples.
CASES = {
    "a future value, causal": (2, 2, Band(None, 0), None, masks.causal("top_left"),
                               lambda k, v: v.__setitem__((..., 7, 0), NAN),
                               [(slice(None), slice(7, 12))]),
    "a key left of a window": (2, 2, Band(3, 0), None, masks.sliding_window(3),
                               lambda k, v: k.__setitem__((..., 4, 1), INF),
                               [(slice(None), slice(4, 8))]),
    "padded keys and values": (4, 2, None, [5, 12], "lengths",
                               lambda k, v: (k.__setitem__((0, ..., 6, 0), NAN),
                                             v.__setitem__((0, ..., slice(9, 12), 2), INF)),
                               []),
    "lengths under a causal band, grouped heads": (
        4, 2, Band(None, 0), [5, 12], "causal & lengths",
        lambda k, v: (v.__setitem__((..., 3, 0), NAN), k.__setitem__((0, ..., 8, 0), NAN)),
        [(slice(None), slice(3, 12))]),
}


def _mask(spec, lengths):
    if spec == "lengths":
        return masks.key_lengths(np.array(lengths))
    if spec == "causal & lengths":
        return masks.causal("top_left") & masks.key_lengths(np.array(lengths))
    return spec


@pytest.mark.parametrize("case", list(CASES))
def test_clearing_keeps_hidden_nonfinite_inputs_out_and_poisons_the_rows_that_see_them(case):
    hq, hkv, band, lengths, mask, spoil, nan_rows = CASES[case]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, h, 12, 8)).astype(np.float32)
               for h in (hq, hkv, hkv))
    want = portattn.attention(q.astype(np.float64), k.astype(np.float64),
                              v.astype(np.float64), mask=_mask(mask, lengths),
                              kernel="reference")
    spoil(k, v)
    plan = Plan(batch_shape=(2,), scale=8 ** -0.5, implementation="xla", band=band,
                fix_rows="band")
    kl = () if lengths is None else (jnp.asarray(lengths),)
    got = np.asarray(attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None, (), kl,
                            (), plan=plan))
    nan = np.zeros(got.shape[:-1], dtype=bool)  # (batch, heads, rows)
    for b, rows in nan_rows:
        nan[b, :, rows] = True
    assert np.isnan(got[nan]).all(), "a row that sees a non-finite input is not NaN"
    assert np.isfinite(got[~nan]).all(), "a hidden non-finite input reached another row"
    np.testing.assert_allclose(got[~nan], want[~nan], rtol=2e-5, atol=2e-5)


def test_the_gradients_of_rows_that_see_no_bad_key_are_unchanged():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 12, 8)), jnp.float32) for _ in "qkv")
    plan = Plan(batch_shape=(1,), scale=8 ** -0.5, implementation="xla", band=Band(None, 0),
                fix_rows="none")

    def dq(v):
        return jax.grad(lambda q: attend(q, k, v, None, (), (), (), plan=plan).sum())(q)

    spoiled = dq(v.at[..., 7, :].set(NAN))
    assert bool(jnp.isnan(spoiled[..., 7:, :]).all())
    np.testing.assert_array_equal(np.asarray(spoiled[..., :7, :]), np.asarray(dq(v)[..., :7, :]))



def test_a_key_a_dense_mask_or_bias_hides_changes_nothing():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 2, 12, 8)).astype(np.float32) for _ in "qkv")
    allowed = rng.random((2, 1, 12, 12)) < 0.7
    allowed[..., 0] = True  # every row keeps a key
    allowed[..., 6] = False
    allowed[1, :, 3, 6] = True  # key 6 is seen by row 3 of batch 1 alone
    bias = rng.standard_normal((2, 2, 12, 12)).astype(np.float32)
    bias[..., 9] = -np.inf  # key 9 is hidden from every row by the bias
    want = portattn.attention(*(a.astype(np.float64) for a in (q, k, v)),
                              mask=masks.dense(allowed), bias=bias.astype(np.float64),
                              kernel="reference")
    k[..., 6, 0], v[..., 9, 1] = NAN, INF
    got = np.asarray(portattn.attention(*(jnp.asarray(a) for a in (q, k, v)),
                                        mask=masks.dense(jnp.asarray(allowed)),
                                        bias=jnp.asarray(bias), kernel="jax_dpa"))
    nan = np.zeros(got.shape[:-1], dtype=bool)
    nan[1, :, 3] = True
    assert np.isnan(got[nan]).all()
    np.testing.assert_allclose(got[~nan], want[~nan], rtol=2e-5, atol=2e-5)
