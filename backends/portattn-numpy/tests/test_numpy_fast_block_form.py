"""Masks reach numpy_fast through their block form: tiles it hides are never computed,
per batch element and head, and every pair it allows is computed once (seen through
the ``on_tile`` hook)."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_numpy import NumpyFastKernel, _blocks, _memo, configured

import portattn
from portattn import attention, masks
from portattn.masks import HIDDEN
from portattn.testing import assert_close, oracle

BATCH, HEADS, LQ, LK = 2, 2, 61, 70


def _ids(seed: int = 0) -> np.ndarray:
    """Document ids of the keys per batch element (their own cuts), with padding (-1)
    at the end of the first."""
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.integers(0, 6, (BATCH, LK)), axis=1)
    ids[0, 60:] = -1
    return ids


def _documents(ids: np.ndarray) -> masks.Mask:
    """Documents whose queries are the last ``LQ`` positions (a chunk of a prefill)."""
    return masks.documents(ids[:, LK - LQ:], ids)


#: Masks whose tiles differ per batch element, per position and by union.
MASKS = {
    "documents": lambda: masks.causal() & _documents(_ids()),
    # one run of keys per row (``_spans``): documents without padding, windows
    "packed": lambda: masks.causal() & _documents(np.sort(
        np.random.default_rng(2).integers(0, 5, (BATCH, LK)), axis=1)),
    "window_in_documents": lambda: masks.sliding_window(7, 3) & masks.documents(np.sort(
        np.random.default_rng(3).integers(0, 4, (BATCH, LQ)), axis=1), np.sort(
        np.random.default_rng(4).integers(0, 4, (BATCH, LK)), axis=1)),
    "top_left_window": lambda: masks.causal("top_left") & masks.sliding_window(11),
    # runs with rows at the ends that see nothing, and keys between documents
    "padded_rows": lambda: masks.causal() & masks.query_lengths(np.array([50, 61]))
    & masks.key_lengths(np.array([60, 70])),
    "documents_apart": lambda: masks.documents(  # padding keys between documents
        np.repeat(np.array([[0, 1, 2, 3], [0, 1, 2, 2]]), [15, 15, 16, 15], axis=1),
        np.repeat(np.array([[0, -1, 1, -1, 2, 3], [0, -1, 1, 2, -1, 3]]),
                  [10, 15, 12, 10, 14, 9], axis=1)),
    "window_or_global": lambda: masks.sliding_window(6) | masks.global_tokens(
        np.array([[4, 40, -1], [20, 21, 69]])),
    "chunks": lambda: masks.chunks(16),
    "prefix_lm": lambda: masks.causal() | masks.prefix(np.array([30, 0])),
    "ranges": lambda: masks.causal() & masks.key_ranges(np.array([5, 33]), np.array([70, 50])),
    "sinks_and_window": lambda: masks.causal() & (masks.sliding_window(9)
                                                  | masks.sink_tokens(3)),
    "block_layout": lambda: masks.block_layout(
        np.random.default_rng(1).random((BATCH, 1, 9, 5)) < 0.4, 8, 16),
    "function_per_head": lambda: masks.function(
        lambda b, h, q, k: (q + 3 * h >= k) & ((q + k + b) % 5 != 0)),
}


def _inputs(seed: int = 0, lq: int = LQ) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((BATCH, HEADS, n, 8)).astype(np.float32)
                 for n in (lq, LK, LK))


def _computed(tiles: list[tuple]) -> np.ndarray:
    """How many times each pair was computed, ``(batch, heads, Lq, Lk)``."""
    times = np.zeros((BATCH, HEADS, LQ, LK), int)
    for (b,), h, q0, q1, k0, k1 in tiles:
        times[b, h, q0:q1, k0:k1] += 1
    return times


def _visible(mask: masks.Mask, config) -> np.ndarray:
    """The pairs in tiles the block form does not hide, on the kernel's grid."""
    bound = mask.bind(np, (BATCH,), HEADS, LQ, LK)
    blocks = masks.block_mask(bound, LQ, LK, config.mask_step, config.mask_chunk)
    states = np.broadcast_to(blocks.states, (BATCH, HEADS, *blocks.states.shape[-2:]))
    pairs = states.repeat(config.mask_step, axis=-2).repeat(config.mask_chunk, axis=-1)
    return pairs[..., :LQ, :LK] != HIDDEN


@pytest.mark.parametrize("name", list(MASKS))
def test_hidden_tiles_are_never_computed_and_allowed_pairs_once(name, tiles, tiny_tiles,
                                                                 threads):
    threads(2)
    mask = MASKS[name]()
    q, k, v = _inputs()
    # a window joined to global tokens runs in parts by default: here, its block form
    with configured(split_global_tokens=False):
        out = attention(q, k, v, mask=mask, kernel="numpy_fast")
    assert_close(out, oracle(*(a.astype(np.float64) for a in (q, k, v)), mask=mask)[0],
                 "float32", "out")
    times = _computed(tiles)
    allowed = np.broadcast_to(mask.bind(np, (BATCH,), HEADS, LQ, LK).tile(
        np, 0, LQ, 0, LK, LQ, LK), times.shape)
    assert (times[allowed] == 1).all(), "an allowed pair was skipped or computed twice"
    assert times.max() == 1, "a pair was computed twice"
    assert not times[~_visible(mask, tiny_tiles)].any(), "a hidden tile was computed"


def test_each_batch_element_skips_its_own_tiles(tiles, tiny_tiles):
    ids = _ids()
    ids[1] = np.repeat(np.arange(7), 10)  # no padding, where batch element 0 has some
    mask = _documents(ids)
    q, k, v = _inputs()
    attention(q, k, v, mask=mask, kernel="numpy_fast")
    times = _computed(tiles)
    assert not times[0, :, :, 60:].any()  # element 0's padding keys: no tile at all
    assert times[1, :, :, 60:].any()  # element 1's same keys are documents
    assert not times[0, :, 60 - (LK - LQ):].any()  # and so are its padding rows


@pytest.mark.parametrize("name", ["documents", "window_or_global", "chunks"])
def test_nan_in_keys_only_hidden_tiles_see_changes_nothing(name, path, tiny_tiles, threads):
    threads(2)
    mask = MASKS[name]()
    q, k, v = _inputs(3)
    allowed = np.broadcast_to(mask.bind(np, (BATCH,), HEADS, LQ, LK).tile(
        np, 0, LQ, 0, LK, LQ, LK), (BATCH, HEADS, LQ, LK))
    bad = 45  # a key some rows see and others do not
    dirty = k.copy()
    dirty[:, :, bad] = np.nan
    out = attention(q, dirty, v, mask=mask, kernel="numpy_fast")
    clean = attention(q, k, v, mask=mask, kernel="numpy_fast")
    sees = allowed[..., bad]
    assert sees.any()
    assert (~sees).any()
    assert np.isnan(out[sees]).all()
    # the others as without it (within rounding: their unit may be redone carefully)
    assert not np.isnan(out[~sees]).any()
    assert_close(out[~sees], clean[~sees], "float32", "out")


def test_plans_are_not_shared_where_the_mask_varies_and_its_block_form_does_not(
        monkeypatch, tiny_tiles):
    # a block form that cannot tell (every tile partial, the same for all) must not let
    # one batch element's plan serve another whose tiles differ
    monkeypatch.setattr(masks.Documents, "block_states", lambda self, grid: None)
    ids = _ids()
    ids[1] = ids[1, ::-1].copy()
    mask = _documents(ids)
    q, k, v = _inputs()
    out = attention(q, k, v, mask=mask, kernel="numpy_fast")
    assert_close(out, oracle(*(a.astype(np.float64) for a in (q, k, v)), mask=mask)[0],
                 "float32", "out")


@pytest.mark.parametrize("name", ["packed", "window_in_documents", "top_left_window",
                                  "padded_rows", "documents_apart"])
def test_masks_of_runs_are_planned_from_them(monkeypatch, tiny_tiles, name):
    planned = []
    real = _blocks.span_blocks

    def recorded(*args):
        planned.append(real(*args))
        return planned[-1]

    monkeypatch.setattr(_blocks, "span_blocks", recorded)
    monkeypatch.setattr(masks.Intersection, "tile", None)  # never read pair by pair
    attention(*_inputs(), mask=MASKS[name](), kernel="numpy_fast")
    assert planned
    assert all(plan is not None for plan in planned)


@pytest.mark.parametrize("runs", [True, False], ids=["runs", "tiles"])
def test_no_mask_is_materialised_for_the_whole_call(monkeypatch, runs):
    # one run of keys per row: planned from the runs, no pair evaluated; else tiles of
    # the block form's partial tiles only, never the whole Lq x Lk
    rng = np.random.default_rng(4)
    n = 2048
    q, k, v = (rng.standard_normal((1, 2, n, 16)).astype(np.float32) for _ in range(3))
    ids = np.repeat(np.arange(8), n // 8)[None]
    mask = masks.causal() & masks.documents(ids)
    if not runs:  # keys apart: a window and sink tokens
        mask = mask & (masks.sliding_window(300) | masks.sink_tokens(4))
    expected = attention(q, k, v, mask=mask, kernel="reference")
    seen: list[int] = []
    real = masks.Intersection.tile

    def recorded(self, xp, q0, q1, k0, k1, *args, **kwargs):
        seen.append((q1 - q0) * (k1 - k0))
        return real(self, xp, q0, q1, k0, k1, *args, **kwargs)

    monkeypatch.setattr(masks.Intersection, "tile", recorded)
    assert_close(attention(q, k, v, mask=mask, kernel="numpy_fast"), expected, "float32",
                 "out")
    if runs:
        assert not seen
    else:
        assert seen
        assert sum(seen) < n * n / 4


def test_every_kind_is_declared_and_packed_documents_dispatch_here():
    assert NumpyFastKernel.masks == frozenset(masks.KINDS)
    q = np.zeros((1, 2, 64, 16), np.float32)
    ids = np.repeat(np.arange(4), 16)[None]
    plan = portattn.explain(q, q, q, mask=masks.causal() & masks.documents(ids))
    assert plan.kernel.name == "numpy_fast"


def test_the_grid_does_not_change_the_result():
    mask = MASKS["window_or_global"]()
    q, k, v = _inputs(5)
    found = []
    for step, chunk in [(1, 1), (2, 4), (8, 16), (128, 64)]:
        with configured(mask_step=step, mask_chunk=chunk, tile_bytes=256, min_block_q=4):
            found.append(attention(q, k, v, mask=mask, return_lse=True, kernel="numpy_fast"))
    for out, lse in found[1:]:
        np.testing.assert_allclose(out, found[0][0], rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(lse, found[0][1], rtol=2e-6, atol=2e-6)


def _packed(n: int = 512) -> tuple[tuple[np.ndarray, ...], masks.Mask]:
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 4, n, 16)).astype(np.float32) for _ in range(3))
    ids = np.sort(rng.integers(0, 5, (2, n)), axis=1)
    return (q, k, v), masks.causal() & masks.documents(ids)


@pytest.mark.parametrize("runs", [True, False], ids=["runs", "tiles"])
def test_each_plan_is_made_once_and_threads_change_nothing(monkeypatch, threads, runs):
    arrays, mask = _packed()
    made = []
    planner = "span_blocks" if runs else "blocks_of"
    real = getattr(_blocks, planner)  # called once for each plan made

    def counted(p, plans, *where):
        made.append(where[-4:] if runs else where[:3])  # (lead, q0, q1), (b, h, q0)
        return real(p, plans, *where)

    if not runs:
        monkeypatch.setattr(masks.Documents, "key_spans", lambda self, lq, lk: None)
    monkeypatch.setattr(_blocks, planner, counted)
    # many units, heads sharing a plan; the same tiles with any number of threads
    _memo.clear_all()  # plans an earlier test made of an equal mask
    with configured(tile_bytes=16 << 10, min_units_per_thread=1):
        threads(1)
        one = attention(*arrays, mask=mask, return_lse=True, kernel="numpy_fast")
        alone = len(made)
        made.clear()
        _memo.clear_all()  # equal masks share their plans: make them again, on 3 threads
        threads(3)
        three = attention(*arrays, mask=mask, return_lse=True, kernel="numpy_fast")
    assert len(made) == len(set(made)) == alone > 1
    for a, b in zip(one, three, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", ["tile", "key_spans"])
def test_a_mask_that_fails_fails_the_call_on_every_thread(monkeypatch, threads, method):
    arrays, mask = _packed()

    def broken(*args, **kwargs):
        msg = "no tile today"
        raise RuntimeError(msg)

    if method == "tile":  # planned from the block form and tiles, not from runs
        monkeypatch.setattr(masks.Documents, "key_spans", lambda self, lq, lk: None)
    monkeypatch.setattr(masks.Documents, method, broken)
    threads(3)
    with configured(tile_bytes=16 << 10), pytest.raises(RuntimeError, match="no tile today"):
        attention(*arrays, mask=mask, kernel="numpy_fast")
