"""Score changes on ``jax_flash``: T5's relative positions (both directions), learned
ALiBi slopes and their sums run on the tiles, forward and under ``jax.jit(jax.grad)``
with their tables' gradients; pair tables and Swin's window table are refused and run
on ``tiled``.

Gradients are checked in float64 against ``jax.grad`` of the textbook formula with the
change's dense entries as a bias, and against ``tiled`` in float32; small blocks make
every call span several tiles, padded ones included.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from jaxcases import jax_backend
from portattn_jax import JaxFlashKernel, register_mask_pytrees

import portattn
from portattn import masks, scores
from portattn.testing import assert_close
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")
from portattn_jax._flash_kernel import flash_plan  # noqa: E402
from textbook import allowed_of, textbook, weighted_loss  # noqa: E402

from portattn.kernel import describe  # noqa: E402

BATCH, HQ, HKV, D = (2,), 4, 2, 8
IDS = np.stack([np.repeat(np.arange(3), [6, 9, 6]), np.repeat(np.arange(2), [12, 9])])


def _change(kind, tables):
    """The change of ``kind`` reading ``tables`` = (buckets (16, Hq), slopes (Hq,))."""
    buckets, slopes = tables
    if kind == "t5_bidirectional":
        return scores.relative_position(buckets, bidirectional=True, max_distance=12)
    if kind == "t5_decoder":
        return scores.relative_position(buckets, bidirectional=False, max_distance=12)
    if kind == "alibi":
        return scores.alibi(slopes)
    return (scores.relative_position(buckets, bidirectional=False, max_distance=12)
            + scores.alibi(slopes))


MASKS = {
    "none": lambda c: None,
    "causal": lambda c: masks.causal(),
    "window": lambda c: masks.sliding_window(5, 2),
    "causal_documents": lambda c: masks.causal() & masks.documents(c(IDS)),
    "window_or_global": lambda c: masks.sliding_window(3) | masks.global_tokens(
        c(np.array([1, 17]))),
}
#: (change, mask, (Lq, Lk), softcap, grouped-query heads)
CASES = {
    "t5_bidirectional_cross": ("t5_bidirectional", "none", (13, 21), None, True),
    "t5_decoder_causal_softcap": ("t5_decoder", "causal", (21, 21), 2.5, False),
    "alibi_window_cross": ("alibi", "window", (13, 21), None, True),
    "sum_documents": ("sum", "causal_documents", (21, 21), None, True),
    "sum_window_or_global_softcap": ("sum", "window_or_global", (21, 21), 3.0, True),
}


@pytest.fixture(autouse=True)
def _jax():
    jax_backend()
    register_mask_pytrees()


def _inputs(lq, lk, grouped, dtype, seed=0):
    rng = np.random.default_rng(seed)
    hkv = HKV if grouped else HQ
    q = rng.standard_normal((*BATCH, HQ, lq, D))
    k, v = (rng.standard_normal((*BATCH, hkv, lk, D)) for _ in range(2))
    tables = (rng.standard_normal((16, HQ)), rng.uniform(0.05, 0.5, HQ))
    w_out, w_lse = rng.standard_normal((*BATCH, HQ, lq, D)), rng.standard_normal((*BATCH, HQ, lq))
    return (tuple(jnp.asarray(a, dtype) for a in (q, k, v)),
            tuple(jnp.asarray(t, dtype) for t in tables), w_out, w_lse)


def _step(kind, softcap, w_out, w_lse):
    """``jit(grad)`` on ``jax_flash`` of a loss over out and lse: ``((dq, dk, dv,
    dtables), (out, lse))``."""
    def loss(q, k, v, tables, mask):
        out, lse = portattn.attention(q, k, v, mask=mask, score_mod=_change(kind, tables),
                                      softcap=softcap, return_lse=True, kernel="jax_flash")
        return weighted_loss(out, lse, w_out, w_lse), (out, lse)

    return jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True))


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_textbook_in_float64(case):
    kind, mask_name, (lq, lk), softcap, grouped = CASES[case]
    (q, k, v), tables, w_out, w_lse = _inputs(lq, lk, grouped, "float64")
    mask = MASKS[mask_name](jnp.asarray)
    allowed = allowed_of(MASKS[mask_name](np.asarray), BATCH, HQ, lq, lk)
    with mock.patch.object(JaxFlashKernel, "max_block", 8):
        plan = flash_plan(describe(q, k, v, mask=mask, score_mod=_change(kind, tables)))
        assert portattn.explain(q, k, v, mask=mask, score_mod=_change(kind, tables)
                                ).kernel.name == "jax_flash"
        step = _step(kind, softcap, w_out, w_lse)
        grads, (out, lse) = step(q, k, v, tables, mask)
        again, _ = step(q, k, v, tables, mask)
    # several tiles each way, the last ones padded
    assert (plan.block_q, plan.block_k) == (8, 8)

    def reference(q, k, v, tables):
        bias = _change(kind, tables).dense(lq, lk)
        out, lse = textbook(q, k, v, allowed=allowed, bias=bias, softcap=softcap)
        return weighted_loss(out, lse, w_out, w_lse), (out, lse)

    want, (want_out, want_lse) = jax.jit(jax.grad(reference, (0, 1, 2, 3), has_aux=True))(
        q, k, v, tables)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-11)
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite],
                               rtol=1e-10, atol=1e-11)
    names = ("dq", "dk", "dv", "dbuckets", "dslopes")
    got, expected = jax.tree.leaves(grads), jax.tree.leaves(want)
    assert len(got) == len(names)
    for name, g, e in zip(names, got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-10, err_msg=name)
    for name, g, h in zip(names, got, jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(g, h, err_msg=f"{name} differs between two runs")


def test_matches_tiled_in_float32():
    """The sum of both kinds, causal, grouped-query heads, with dropout: the same pairs
    dropped by both kernels, the same results to float32 rounding."""
    (q, k, v), tables, w_out, w_lse = _inputs(21, 21, True, "float32", seed=3)

    def loss(q, k, v, tables, kernel):
        out, lse = portattn.attention(q, k, v, mask=masks.causal(), return_lse=True,
                                      score_mod=_change("sum", tables), kernel=kernel,
                                      dropout_p=0.2, dropout_seed=7)
        return weighted_loss(out, lse, w_out, w_lse), (out, lse)

    step = jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True), static_argnums=4)
    with mock.patch.object(JaxFlashKernel, "max_block", 8):
        flash = step(q, k, v, tables, "jax_flash")
    tiled = step(q, k, v, tables, "tiled")
    names = ("dq", "dk", "dv", "dbuckets", "dslopes", "out", "lse")
    for name, got, want in zip(names, jax.tree.leaves(flash), jax.tree.leaves(tiled),
                               strict=True):
        assert got.dtype == want.dtype, name
        assert_close(got, np.asarray(want, np.float64), "float32", name)


def test_tables_not_trained():
    """Gradients for q, k, v alone (the tables constants): no table gradient is summed,
    and q's is the same as with it."""
    (q, k, v), tables, w_out, _ = _inputs(13, 21, True, "float64", seed=1)

    def loss(q, tables):
        out = portattn.attention(q, k, v, score_mod=_change("t5_bidirectional", tables),
                                 kernel="jax_flash")
        return jnp.sum(out * w_out)

    with mock.patch.object(JaxFlashKernel, "max_block", 8):
        alone = jax.jit(jax.grad(loss))(q, tables)
        both, _ = jax.jit(jax.grad(loss, (0, 1)))(q, tables)
    np.testing.assert_allclose(alone, both, rtol=1e-12, atol=1e-13)


REFUSED = {
    "pair_table": lambda t, rng: scores.pair_table(
        jnp.asarray(rng.standard_normal((3, 2, HQ))), jnp.asarray(rng.integers(0, 3, (2, 9))),
        jnp.asarray(rng.integers(0, 2, (2, 9)))),
    "window_table": lambda t, rng: scores.window_table(
        jnp.asarray(rng.standard_normal((25, HQ))), (3, 3)),
    "t5_and_pairs": lambda t, rng: _change("t5_decoder", t) + REFUSED["pair_table"](t, rng),
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_other_kinds_are_refused_and_run_on_tiled(kind):
    rng = np.random.default_rng(2)
    (q, k, v), tables, _, _ = _inputs(9, 9, False, "float64")
    change = REFUSED[kind](tables, rng)
    reasons = JaxFlashKernel.not_supported_reasons(describe(q, k, v, score_mod=change))
    assert len(reasons) == 1
    assert "not supported (supported: alibi, relative_position)" in reasons[0], reasons
    plan = portattn.explain(q, k, v, mask=masks.causal(), score_mod=change)
    assert plan.kernel.name == "tiled"
    with pytest.raises(ValueError, match="not supported"):
        portattn.attention(q, k, v, score_mod=change, kernel="jax_flash")


def test_dispatch_picks_jax_flash():
    (q, k, v), tables, _, _ = _inputs(64, 64, True, "float32")
    change = _change("t5_decoder", tables)
    assert portattn.explain(q, k, v, mask=masks.causal(), score_mod=change).kernel.name \
        == "jax_flash"

    @jax.jit
    def traced(q, k, v, tables):
        plan = portattn.explain(q, k, v, mask=masks.causal(), score_mod=_change("sum", tables))
        chosen.append(plan.kernel.name)
        return q

    chosen = []
    traced(q, k, v, tables)
    assert chosen == ["jax_flash"]
