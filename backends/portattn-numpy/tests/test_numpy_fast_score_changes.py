"""Score changes (``score_mod``) on numpy_fast: every kind against the portable ``tiled``
kernel on float64 copies, under every mask shape and strategy, with Numba's loops and
with NumPy's alone; dispatch picks numpy_fast for them; each entry is made once."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from portattn_numpy import _jit, configured
from portattn_numpy._changes import distance_entries, entries_lead, shift_of

import portattn
from portattn import masks, scores
from portattn.testing import assert_close

HEADS, KV_HEADS, WINDOW = 4, 2, (6, 8)
LENGTH = WINDOW[0] * WINDOW[1]  # window_table reads one window: Lq = Lk = Wh * Ww


def _tables(dtype):
    """Each kind's arrays: the same draws whatever the dtype (cast from float64)."""
    rng = np.random.default_rng(7)
    return {
        "buckets": rng.standard_normal((32, HEADS)).astype(dtype),
        "slopes": rng.uniform(0.05, 0.5, HEADS).astype(dtype),
        "offsets": rng.standard_normal(((2 * WINDOW[0] - 1) * (2 * WINDOW[1] - 1), HEADS)
                                       ).astype(dtype),
        "pairs": rng.standard_normal((3, 4, HEADS)).astype(dtype),
    }


def _classes(batch, q_len, kv_len):
    rng = np.random.default_rng(8)
    return rng.integers(0, 3, (batch, q_len)), rng.integers(0, 4, (batch, kv_len))


#: Each kind, from its arrays and the call's (batch, Lq, Lk).
KINDS = {
    "t5_decoder": lambda t, shape: scores.relative_position(
        t["buckets"], bidirectional=False, max_distance=20),
    "t5_encoder": lambda t, shape: scores.relative_position(t["buckets"], max_distance=20),
    "alibi": lambda t, shape: scores.alibi(t["slopes"]),
    "window": lambda t, shape: scores.window_table(t["offsets"], WINDOW),
    "pairs": lambda t, shape: scores.pair_table(t["pairs"], *_classes(*shape)),
    "t5_plus_alibi": lambda t, shape: (KINDS["t5_encoder"](t, shape)
                                       + KINDS["alibi"](t, shape)),
    "t5_plus_pairs": lambda t, shape: (KINDS["t5_decoder"](t, shape)
                                       + KINDS["pairs"](t, shape)),
    "window_plus_alibi": lambda t, shape: (KINDS["window"](t, shape)
                                           + KINDS["alibi"](t, shape)),
}
BY_DISTANCE = ("t5_decoder", "t5_encoder", "alibi", "t5_plus_alibi")


def _documents(batch, length):
    ids = np.sort(np.random.default_rng(9).integers(0, 3, (batch, length)), axis=-1)
    return masks.documents(ids)


MASKS = {
    "none": lambda batch, length: None,
    "causal": lambda batch, length: masks.causal(),
    "window": lambda batch, length: masks.sliding_window(9, 3),
    "causal_documents": lambda batch, length: masks.causal() & _documents(batch, length),
}

_NEEDS_NUMBA = pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                  reason="Numba is not installed")


@pytest.fixture(params=[pytest.param("numba", marks=_NEEDS_NUMBA), "numpy"])
def loops(request, monkeypatch):
    """Numba's compiled loops (exponentials, blocks, adds), or NumPy's calls alone, as
    where Numba is not installed."""
    if request.param == "numba":
        yield request.param
        return
    monkeypatch.setattr(_jit, "load", lambda name: None)
    with configured(exponential="exp2"):  # NumPy's: the fastest here may be compiled
        yield request.param


@pytest.fixture(params=["stacked", "diagonal", "tiles"])
def strategy(request):
    """Whole heads stacked (the default for these small calls); tiny tiles along the
    diagonal (where the mask is causal-shaped); tiny tiles alone."""
    if request.param == "stacked":
        yield request.param
        return
    ways = ("diagonal", "tiles") if request.param == "diagonal" else ("tiles",)
    with configured(tile_bytes=64, min_block_q=4, preferred_block_q=2, max_block_k=8,
                    mask_chunk=4, mask_step=2, min_squares=2, strategies=ways):
        yield request.param


def _compare(kind, q_shape, k_shape, dtype, *, mask_of=None, **kwargs):
    """numpy_fast's out and lse against tiled's on float64 copies of the same values."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal(k_shape).astype(dtype)
    v = rng.standard_normal((*k_shape[:-1], 5)).astype(dtype)
    batch, q_len, kv_len = q_shape[0], q_shape[-2], k_shape[-2]
    mask = None if mask_of is None else mask_of(batch, kv_len)
    tables = _tables(dtype)
    change = KINDS[kind](tables, (batch, q_len, kv_len))
    wide = KINDS[kind]({n: a.astype(np.float64) for n, a in tables.items()},
                       (batch, q_len, kv_len))
    out, lse = portattn.attention(q, k, v, mask=mask, score_mod=change, return_lse=True,
                                  kernel="numpy_fast", **kwargs)
    wide_kwargs = {n: (a.astype(np.float64) if isinstance(a, np.ndarray) else a)
                   for n, a in kwargs.items()}
    want, want_lse = portattn.attention(
        *(a.astype(np.float64) for a in (q, k, v)), mask=mask, score_mod=wide,
        return_lse=True, kernel="tiled", **wide_kwargs)
    if np.dtype(dtype) == np.float64:  # the same sums, in another order
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    else:
        assert_close(out, want, np.dtype(dtype).name, "out")
        assert_close(lse, want_lse, np.dtype(dtype).name, "lse")
    return out, lse


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_matches_tiled(kind, mask, dtype, strategy, loops):
    # heads of 16: a window table's entries fit in the call's memory at once (and are
    # stacked), a pair table's are made in bands
    _compare(kind, (2, HEADS, LENGTH, 16), (2, KV_HEADS, LENGTH, 16), dtype,
             mask_of=MASKS[mask])


@pytest.mark.parametrize("path", ["fast", "careful"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_either_way_through_a_unit(kind, path, loops):
    # the careful way (online softmax) adds the entries in its own loop
    with configured(try_fast=path == "fast", tile_bytes=64, min_block_q=4,
                    preferred_block_q=2, max_block_k=8, mask_chunk=4, mask_step=2):
        _compare(kind, (1, HEADS, LENGTH, 8), (1, HEADS, LENGTH, 8), "float64",
                 mask_of=MASKS["causal"])


@pytest.mark.parametrize("option", [{"softcap": 2.0},
                                    {"bias": np.linspace(-1, 1, LENGTH * LENGTH)
                                     .reshape(LENGTH, LENGTH)},
                                    {"scale": 0.9}], ids=["softcap", "bias", "scale"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_with_softcap_bias_and_scale(kind, option, loops):
    _compare(kind, (2, HEADS, LENGTH, 8), (2, KV_HEADS, LENGTH, 8), "float64",
             mask_of=MASKS["causal"], **option)


@pytest.mark.parametrize("lengths", [(17, 48), (48, 17), (100, 300), (1, 300)],
                         ids=["fewer_queries", "more_queries", "longer", "decode_step"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("kind", [k for k in sorted(KINDS) if "window" not in k])
def test_queries_and_keys_of_other_lengths(kind, mask, lengths, loops):
    # queries sit at the keys' last positions (bottom-right), where the entries read
    # their distances from
    q_len, kv_len = lengths
    _compare(kind, (2, HEADS, q_len, 8), (2, KV_HEADS, kv_len, 8), "float32",
             mask_of=MASKS[mask])


@pytest.mark.parametrize("kind", ["t5_decoder", "alibi", "t5_plus_alibi"])
def test_a_long_causal_call_runs_along_the_diagonal_compiled(kind, monkeypatch):
    # the changes by distance keep the fast loops: base 2, squares along the diagonal,
    # the blocks in one compiled call that adds the entries
    pytest.importorskip("numba")
    from portattn_numpy import _compiled_blocks

    shifted = []
    accumulate = _compiled_blocks.CompiledBlocks.accumulate

    def counted(self, *args, shift=None, **kwargs):
        shifted.append(shift is not None)
        return accumulate(self, *args, shift=shift, **kwargs)

    monkeypatch.setattr(_compiled_blocks.CompiledBlocks, "accumulate", counted)
    seen = []
    with configured(on_unit=lambda name, trusted: seen.append(name),
                    exponential="exp2_compiled"):
        _compare(kind, (1, HEADS, 700, 16), (1, HEADS, 700, 16), "float32",
                 mask_of=MASKS["causal"])
    assert set(seen) == {"diagonal"}
    assert shifted
    assert all(shifted)


@pytest.mark.parametrize("kind", ["window", "pairs", "t5_plus_pairs"])
def test_entries_made_once_for_every_head(kind, monkeypatch, loops):
    # a change that is not by distance gives every batch element's and head's entries
    # of a range at once: numpy_fast makes each once (a band of rows at a time where
    # all of them would take more memory than the call's arrays), not once per head
    shape = (2, HEADS, LENGTH, 8)
    change = KINDS[kind](_tables(np.float32), (2, LENGTH, LENGTH))
    made = []
    entries = type(change).entries

    def counted(self, xp, q0, q1, k0, k1, *args):
        if self is bound[0]:
            made.append((q1 - q0) * (k1 - k0))
        return entries(self, xp, q0, q1, k0, k1, *args)

    bound = []
    bind = type(change).bind
    monkeypatch.setattr(type(change), "bind",
                        lambda self, *a: bound.append(bind(self, *a)) or bound[-1])
    monkeypatch.setattr(type(change), "entries", counted)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    portattn.attention(q, k, v, score_mod=change, kernel="numpy_fast")
    assert sum(made) <= LENGTH * LENGTH + 1  # the +1: one entry, to learn their shape
    if kind != "window":
        # the pairs' entries, per batch element: all of them would take more memory
        # than the call's arrays, so they come in bands that take no more
        assert len(made) > 2
        assert max(made) * 2 * HEADS <= 4 * q.size


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dispatch_picks_numpy_fast(kind):
    q = np.zeros((2, HEADS, LENGTH, 8), np.float32)
    change = KINDS[kind](_tables(np.float32), (2, LENGTH, LENGTH))
    plan = portattn.explain(q, q, q, mask=masks.causal(), score_mod=change)
    assert plan.kernel.name == "numpy_fast"


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("kind", ["t5_decoder", "window", "pairs"])
def test_minus_infinity_entries_hide_non_finite_values(kind, mask, loops):
    # an entry of -inf hides its key like a mask: a NaN value there reaches no row
    # that only it hides, and a row it hides wholly gets output 0, lse -inf; a far
    # negative entry hides nothing, even where its weight underflows to 0
    rng = np.random.default_rng(3)
    tables = _tables(np.float64)
    for name in ("buckets", "offsets"):
        tables[name][:4] = -np.inf
        tables[name][4:8] = -1e4
    tables["pairs"][0] = -np.inf
    tables["pairs"][1, 0] = -1e4
    change = KINDS[kind](tables, (1, LENGTH, LENGTH))
    q, k, v = (rng.standard_normal((1, HEADS, LENGTH, 8)) for _ in range(3))
    v[..., 5, :] = np.nan
    mask = MASKS[mask](1, LENGTH)
    got = portattn.attention(q, k, v, mask=mask, score_mod=change, return_lse=True,
                             kernel="numpy_fast")
    want = portattn.attention(q, k, v, mask=mask, score_mod=change, return_lse=True,
                              kernel="tiled")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_a_band_joined_to_global_tokens_reads_each_row_at_its_position(loops):
    # the three parts that usually compute this mask renumber the global rows: with a
    # change that reads the rows' positions the union runs as one mask
    mask = masks.sliding_window(6, 0) | masks.global_tokens(np.array([3, 30]))
    _compare("t5_encoder", (1, HEADS, 200, 8), (1, HEADS, 200, 8), "float64",
             mask_of=lambda batch, length: mask)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_views_hold_the_entries_of_any_tile(kind):
    shape = (2, 40, 40) if "window" not in kind else (2, LENGTH, LENGTH)
    _, lq, lk = shape
    change = KINDS[kind](_tables(np.float64), shape).bind(np, "cpu", (2,), HEADS, lq, lk)
    dense = change.dense(lq, lk)
    dense = dense.reshape((1,) * (4 - dense.ndim) + dense.shape)
    lead = entries_lead(change, lq, lk, 4)
    shift = shift_of(change, distance_entries(change, lq, lk), lq, lk, 4, np.float64,
                     base_e=True, lead=lead)
    for q0, q1, k0, k1 in [(0, lq, 0, lk), (3, 9, 20, 37), (lq - 1, lq, 0, 1), (5, 6, 0, lk)]:
        for b, h in [((0,), 0), ((1,), HEADS - 1)]:
            want = dense[(*(0 if dense.shape[0] == 1 else i for i in b), h)][q0:q1, k0:k1]
            np.testing.assert_array_equal(shift.keys_by_queries(b, h, q0, q1, k0, k1), want.T)
    whole = np.broadcast_to(dense, (2, HEADS, lq, lk)).swapaxes(-1, -2)
    if shift.stackable:
        np.testing.assert_array_equal(
            np.broadcast_to(shift.stacked((1,), 0, 2, 2), (2, 2, lk, lq)),
            whole[1].reshape(2, 2, lk, lq))


@pytest.mark.parametrize("lengths", [(0, 9), (9, 0)])
@pytest.mark.parametrize("kind", ["t5_decoder", "alibi", "pairs"])
def test_calls_without_pairs(kind, lengths):
    q_len, kv_len = lengths
    q = np.ones((2, HEADS, q_len, 8), np.float32)
    k = np.ones((2, HEADS, kv_len, 8), np.float32)
    change = KINDS[kind](_tables(np.float32), (2, q_len, kv_len))
    out, lse = portattn.attention(q, k, k, score_mod=change, return_lse=True,
                                  kernel="numpy_fast")
    np.testing.assert_array_equal(out, np.zeros_like(out))
    np.testing.assert_array_equal(lse, np.full_like(lse, -np.inf))


@pytest.mark.parametrize("table_dtype", [np.float64, np.float16])
@pytest.mark.parametrize("kind", ["t5_encoder", "pairs", "t5_plus_pairs"])
def test_tables_of_another_dtype_join_in_the_scores_dtype(kind, table_dtype):
    # as tiled does: each entry rounded to the scores' dtype, then added
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, HEADS, 64, 8)).astype(np.float32) for _ in range(3))
    change = KINDS[kind](_tables(table_dtype), (2, 64, 64))
    got = portattn.attention(q, k, v, score_mod=change, kernel="numpy_fast")
    want = portattn.attention(q, k, v, score_mod=change, kernel="tiled")
    assert_close(got, want.astype(np.float64), "float32")


@pytest.mark.parametrize("kind", ["t5_decoder", "pairs"])
def test_threads_change_nothing(kind, threads):
    # the same tiles on any number of threads: the same sums, bit for bit
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, HEADS, 300, 8)).astype(np.float32) for _ in range(3))
    change = KINDS[kind](_tables(np.float32), (2, 300, 300))
    got = []
    for count in (1, 3):
        threads(count)
        with configured(min_scores_per_thread=1, min_units_per_thread=1, tile_bytes=4096,
                        strategies=("tiles",)):
            got.append(portattn.attention(q, k, v, mask=masks.causal(), score_mod=change,
                                          kernel="numpy_fast"))
    np.testing.assert_array_equal(got[0], got[1])
