"""The block form and the index form of every mask kind, against its tiles.

A mask's ``tile`` over the whole call is the truth here. Its block form must never
call a tile hidden that holds an allowed pair, nor full one that holds a hidden pair;
for a single kind whose values can be read it must be exact. ``allows`` at index
arrays must give the same pairs as ``tile``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portattn import masks
from portattn.masks import FULL, HIDDEN, PARTIAL

BATCH, HEADS = (2,), 3


def _catalogue(lq: int, lk: int, rng: np.random.Generator) -> dict[str, masks.Mask]:
    """One mask of every kind (and some combinations) for a call of ``lq x lk``."""
    def lengths(limit: int) -> np.ndarray:
        return rng.integers(0, limit + 1, BATCH)

    starts = rng.integers(0, lk + 1, BATCH)
    ids = np.sort(rng.integers(-1, 3, (*BATCH, max(lq, lk))), axis=-1)
    layout_rows, layout_cols = math.ceil(lk / 4), math.ceil(lk / 3)
    kinds = {
        "causal": masks.causal(),
        "causal_top_left": masks.causal("top_left"),
        "window": masks.sliding_window(3, 1),
        "key_lengths": masks.key_lengths(lengths(lk)),
        "query_lengths": masks.query_lengths(lengths(lq)),
        "dense": masks.dense(rng.random((*BATCH, HEADS, lq, lk)) < 0.5),
        "key_ranges": masks.key_ranges(starts, np.maximum(starts, lengths(lk))),
        "query_ranges": masks.query_ranges(np.zeros(BATCH, int), lengths(lq)),
        "sequence_window": masks.sequence_window(2, 1, query_lengths=lengths(lq),
                                                 key_lengths=lengths(lk)),
        "documents": masks.documents(ids[..., :lq], ids[..., :lk]),
        "prefix": masks.prefix(lengths(lk)),
        "sink_tokens": masks.sink_tokens(int(rng.integers(0, 4))),
        "global_tokens": masks.global_tokens(np.array([0, lk // 2, -1])),
        "global_tokens_per_batch": masks.global_tokens(rng.integers(-1, max(lk, 1), (*BATCH, 2))),
        "chunks": masks.chunks(int(rng.integers(1, 6))),
        "block_layout": masks.block_layout(rng.random((HEADS, layout_rows, layout_cols)) < 0.5,
                                           4, 3),
        "function": masks.function(lambda b, h, q, k: ((q - k) % (h + 2) == 0) | (k < b + 2)),
    }
    kinds["prefix_lm"] = masks.causal() | kinds["prefix"]
    kinds["window_or_sinks"] = masks.causal() & (kinds["window"] | kinds["sink_tokens"])
    kinds["window_or_global"] = kinds["window"] | kinds["global_tokens"]
    kinds["causal_documents"] = masks.causal() & kinds["documents"]
    kinds["two_windows"] = masks.sliding_window(4, 2) & masks.causal("top_left")
    return kinds


KIND_NAMES = list(_catalogue(8, 8, np.random.default_rng(0)))
#: Combinations whose parts' tiles may hide each other's pairs: sound, not exact.
NOT_EXACT = {"prefix_lm", "window_or_sinks", "window_or_global", "causal_documents"}


def _truth(mask: masks.Mask, lq: int, lk: int) -> np.ndarray:
    """Every pair the bound mask allows, ``(*batch, H, lq, lk)``."""
    tile = mask.tile(np, 0, lq, 0, lk, lq, lk)
    return np.broadcast_to(tile, (*BATCH, HEADS, lq, lk))


def _bound(name: str, lq: int, lk: int, seed: int) -> masks.Mask:
    mask = _catalogue(lq, lk, np.random.default_rng(seed))[name]
    return mask.bind(np, BATCH, HEADS, lq, lk)


shapes = st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(1, 9), st.integers(1, 9),
                   st.integers(0, 2**16))


@pytest.mark.parametrize("name", KIND_NAMES)
@settings(max_examples=25, deadline=None)
@given(shape=shapes)
def test_block_form_is_sound_and_single_kinds_are_exact(name, shape):
    lq, lk, block_q, block_k, seed = shape
    mask = _bound(name, lq, lk, seed)
    truth = _truth(mask, lq, lk)
    form = masks.block_mask(mask, lq, lk, block_q, block_k)
    states = np.broadcast_to(form.states, (*BATCH, HEADS, form.num_q_blocks, form.num_kv_blocks))
    exact = name not in NOT_EXACT
    for a in range(form.num_q_blocks):
        q0, q1 = form.q_range(a)
        for b in range(form.num_kv_blocks):
            k0, k1 = form.kv_range(b)
            pairs = truth[..., q0:q1, k0:k1]
            some, every = pairs.any(axis=(-2, -1)), pairs.all(axis=(-2, -1))
            state = states[..., a, b]
            assert not (some & (state == HIDDEN)).any(), f"an allowed pair in a hidden tile {a, b}"
            assert not (~every & (state == FULL)).any(), f"a hidden pair in a full tile {a, b}"
            if exact:
                assert (state == np.where(~some, HIDDEN, np.where(every, FULL, PARTIAL))).all()


@pytest.mark.parametrize("name", KIND_NAMES)
@settings(max_examples=15, deadline=None)
@given(shape=shapes)
def test_allows_at_indices_equals_the_tile(name, shape):
    lq, lk, _, _, seed = shape
    mask = _bound(name, lq, lk, seed)
    b = np.arange(math.prod(BATCH)).reshape(*BATCH, 1, 1, 1)
    h = np.arange(HEADS).reshape(HEADS, 1, 1)
    q, k = np.arange(lq)[:, None], np.arange(lk)[None, :]
    got = np.broadcast_to(mask.allows(np, b, h, q, k, lq, lk), (*BATCH, HEADS, lq, lk))
    np.testing.assert_array_equal(got, _truth(mask, lq, lk))


#: Kinds whose rows each attend one run of keys, and say so (``Mask.key_spans``).
RUNS = {"causal", "causal_top_left", "window", "documents", "causal_documents", "two_windows",
        "key_lengths", "query_lengths", "key_ranges", "query_ranges", "sequence_window"}


@pytest.mark.parametrize("name", KIND_NAMES)
@settings(max_examples=15, deadline=None)
@given(shape=shapes)
def test_runs_of_keys_are_the_tile(name, shape):
    lq, lk, _, _, seed = shape
    mask = _bound(name, lq, lk, seed)
    spans = mask.key_spans(lq, lk)
    assert (spans is not None) == (name in RUNS)
    if spans is None:
        return
    np.testing.assert_array_equal(_pairs_of_runs(spans, lq, lk), _truth(mask, lq, lk))


def _pairs_of_runs(spans: tuple[np.ndarray, np.ndarray], lq: int, lk: int) -> np.ndarray:
    """The pairs ``Mask.key_spans`` allows, ``(*batch, H, lq, lk)``."""
    start, stop = (np.broadcast_to(a, (*BATCH, HEADS, lq))[..., None] for a in spans)
    keys = np.arange(lk)
    return (keys >= start) & (keys < stop)


@settings(max_examples=40, deadline=None)
@given(hidden_shape=st.lists(st.integers(1, 3), max_size=3),
       full_shape=st.lists(st.integers(1, 3), max_size=3), seed=st.integers(0, 2**16))
def test_tile_states_name_each_tile_as_the_rule_says(hidden_shape, full_shape, seed):
    """NumPy's states (built by arithmetic on the booleans) are hidden where ``hidden``,
    else full where ``full``, else partial, in the broadcast shape, as int8."""
    # sizes of 1 broadcast against any size: make the shapes compatible, right-aligned
    width = max(len(hidden_shape), len(full_shape))
    hidden_shape, full_shape = ([1] * (width - len(x)) + x for x in (hidden_shape, full_shape))
    full_shape = [f if f == h or 1 in (f, h) else 1
                  for h, f in zip(hidden_shape, full_shape, strict=True)]
    rng = np.random.default_rng(seed)
    hidden, full = rng.random(hidden_shape) < 0.4, rng.random(full_shape) < 0.5
    states = masks.tile_states(hidden, full)
    assert isinstance(states, np.ndarray)
    assert states.dtype == np.int8
    want = np.where(hidden, HIDDEN, np.where(full, FULL, PARTIAL))
    np.testing.assert_array_equal(states, want)
    # scalars, and views with negative strides, too
    assert masks.tile_states(np.True_, np.True_) == HIDDEN
    assert masks.tile_states(False, np.ones((2, 2), bool)[:, ::-1]).tolist() == [[FULL] * 2] * 2


@pytest.mark.parametrize("lk", [0, 5])
def test_a_function_over_no_query_has_no_tile(lk):
    mask = masks.function(lambda b, h, q, k: (q + k) % 3 == 0).bind(np, BATCH, HEADS, 0, lk)
    assert mask.block_states(masks.Grid(np.zeros(1, np.int64), np.array([0, lk]), 0,
                                        lk)).shape == (0, 1)
    assert masks.block_mask(mask, 0, lk, 4, 4).states.size == 0


def test_documents_whose_keys_lie_apart_have_no_runs():
    ids = np.array([[0, 0, 1, 1, 0], [0, 0, 1, 1, 2]])
    assert masks.documents(ids).bind(np, (2,), 1, 5, 5).key_spans(5, 5) is None
    assert masks.documents(ids[1]).key_spans(5, 5) is None  # not bound: not read


@pytest.mark.parametrize("name", ["documents", "key_lengths", "global_tokens_per_batch",
                                  "causal_documents", "prefix_lm", "sequence_window",
                                  "key_ranges"])
def test_restricted_masks_keep_their_pairs(name):
    lq, lk = 23, 29
    mask = _bound(name, lq, lk, 3)
    truth = _truth(mask, lq, lk)
    for q0, q1, k0, k1 in ((0, 7, 5, 20), (9, 23, 0, 29), (4, 5, 28, 29)):
        part = mask.restrict(np, q0, q1, k0, k1, lq, lk)
        got = np.broadcast_to(part.tile(np, 0, q1 - q0, 0, k1 - k0, q1 - q0, k1 - k0),
                              (*BATCH, HEADS, q1 - q0, k1 - k0))
        np.testing.assert_array_equal(got, truth[..., q0:q1, k0:k1])
        spans = part.key_spans(q1 - q0, k1 - k0)
        if spans is not None:  # the runs of keys follow the part too
            np.testing.assert_array_equal(_pairs_of_runs(spans, q1 - q0, k1 - k0), got)
        form = masks.block_mask(part, q1 - q0, k1 - k0, 4, 4)
        states = np.broadcast_to(form.states, (*BATCH, HEADS, *form.states.shape[-2:]))
        hidden = states == HIDDEN
        for a, b in zip(*np.nonzero(hidden.any(axis=(0, 1))), strict=True):
            r0, r1 = form.q_range(int(a))
            c0, c1 = form.kv_range(int(b))
            assert not (got[..., r0:r1, c0:c1].any(axis=(-2, -1)) & hidden[..., a, b]).any()


def test_values_that_cannot_be_read_leave_tiles_partial(monkeypatch):
    # As under jax.jit or torch.compile: only the positional parts skip tiles.
    from portattn.masks import _documents, _lengths

    monkeypatch.setattr(_documents, "host_copy", lambda a: None)
    monkeypatch.setattr(_lengths, "host_copy", lambda a: None)
    ids = np.repeat(np.arange(4), 8)[None]
    mask = (masks.causal() & masks.documents(ids) & masks.key_lengths(np.array([5]))).bind(
        np, (1,), 1, 32, 32)
    form = masks.block_mask(mask, 32, 32, 8, 8)
    causal_only = masks.block_mask(masks.causal(), 32, 32, 8, 8)
    expected = np.minimum(causal_only.states, PARTIAL)  # no tile full: some part unknown
    np.testing.assert_array_equal(form.merged, expected)


def test_documents_skip_tiles_per_batch_element():
    ids = np.array([[0] * 16 + [1] * 16, [0] * 32])
    form = masks.block_mask(masks.documents(ids).bind(np, (2,), 1, 32, 32), 32, 32, 16, 16)
    assert form.states.shape == (2, 1, 2, 2)
    assert (form.states[0, 0] == [[FULL, HIDDEN], [HIDDEN, FULL]]).all()
    assert (form.states[1, 0] == FULL).all()
    assert (form.merged == [[FULL, PARTIAL], [PARTIAL, FULL]]).all()


def test_tables_list_the_tiles_of_the_states():
    mask = (masks.causal() & masks.documents(np.repeat([0, 1, 2], [10, 30, 24]))).bind(
        np, (), 1, 64, 64)
    form = masks.block_mask(mask, 64, 64, 16, 16)
    tables = form.tables()
    states = form.states[0]  # one head, shared: the lead axis has size 1
    assert form.states.shape == (1, 4, 4)
    for a in range(form.num_q_blocks):
        for state, count, index in ((PARTIAL, tables.kv_num_blocks, tables.kv_indices),
                                    (FULL, tables.full_kv_num_blocks, tables.full_kv_indices)):
            listed = index[0, a, :count[0, a]]
            assert listed.tolist() == np.nonzero(states[a] == state)[0].tolist()
    for b in range(form.num_kv_blocks):
        listed = tables.q_indices[0, b, :tables.q_num_blocks[0, b]]
        assert listed.tolist() == np.nonzero(states[:, b] == PARTIAL)[0].tolist()
    assert form.kv_blocks(0) == [(0, False)]
    assert 0 < form.visible < masks.block_mask(masks.causal(), 64, 64, 16, 16).visible


def _counted_causal(calls):
    def fn(b, h, q, k):
        calls.append(q.size * k.size)  # bind also checks one pair
        return q >= k
    return fn


def test_a_function_that_declares_its_reads_is_evaluated_once_per_shape():
    calls = []
    mask = masks.function(_counted_causal(calls), args=())
    for _ in range(3):  # as three layers would call it
        bound = mask.bind(np, (1,), 2, 64, 64)
        form = masks.block_mask(bound, 64, 64, 16, 16)
        assert (form.merged == masks.block_mask(masks.causal(), 64, 64, 16, 16).merged).all()
    evaluated = sum(n for n in calls if n > 1)
    assert evaluated == 64 * 64  # every pair once, for the first call
    # a new mask object of the same function and arguments is the same mask
    again = masks.function(mask.fn, args=())
    masks.block_mask(again.bind(np, (1,), 2, 64, 64), 64, 64, 16, 16)
    assert sum(n for n in calls if n > 1) == evaluated  # nothing evaluated again


def test_a_function_that_may_read_anything_is_evaluated_at_every_call():
    calls = []
    mask = masks.function(_counted_causal(calls))
    for _ in range(3):
        masks.block_mask(mask.bind(np, (1,), 2, 64, 64), 64, 64, 16, 16)
    assert sum(n for n in calls if n > 1) == 3 * 64 * 64


def test_kinds_of_a_union_name_the_union_and_its_members():
    mask = masks.causal() & (masks.sliding_window(8) | masks.sink_tokens(4))
    assert mask.kinds == {"causal", "union", "sliding_window", "sink_tokens"}
    assert mask == masks.causal() & (masks.sliding_window(8) | masks.sink_tokens(4))
    assert "|" in repr(mask)


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: masks.sink_tokens(-1), ValueError, "sink_tokens count must be an int >= 0"),
    (lambda: masks.chunks(0), ValueError, "chunks size must be an int >= 1; got size=0"),
    (lambda: masks.block_layout(np.ones((2, 2), bool), 0), ValueError, "block_q must be"),
    (lambda: masks.global_tokens("1, 2"), TypeError, "global_tokens expects an integer array"),
    (lambda: masks.function(3), TypeError, "function expects a callable"),
])
def test_bad_constructor_arguments_are_named(build, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()


@pytest.mark.parametrize(("mask", "error", "message"), [
    (lambda: masks.block_layout(np.ones((3, 2), bool), 4), ValueError,
     "must end in (ceil(Lk / block_q), ceil(Lk / block_k)) = (2, 2)"),
    (lambda: masks.block_layout(np.ones((2, 2), int), 4), TypeError, "dtype bool"),
    (lambda: masks.global_tokens(np.array([3, 8])), ValueError,
     "global_tokens positions must lie below Lk=8 (negative ones are unused); got positions "
     "with max=8"),
    (lambda: masks.global_tokens(np.zeros((3, 1), int)), ValueError, "(n,) or (*batch, n)"),
    (lambda: masks.prefix(np.array([9, 1])), ValueError, "prefix lengths must lie in [0, Lk=8]"),
    (lambda: masks.function(lambda b, h, q, k: q - k), TypeError,
     "a mask function must return a boolean array; got dtype=int64"),
])
def test_bad_masks_are_named_when_bound(mask, error, message):
    import portattn

    q = np.zeros((2, 1, 8, 4), np.float32)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace(
            "[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        portattn.attention(q, q, q, mask=mask())


@pytest.mark.parametrize("name", ["documents", "key_ranges", "prefix_lm", "global_tokens_per_batch",
                                  "block_layout", "dense", "sequence_window", "function",
                                  "window_or_sinks"])
def test_allows_runs_on_every_library(name, backend):
    # The index form is what compiled kernels evaluate inside their loops.
    if backend.name == "dask":
        pytest.skip("dask takes no multi-dimensional integer indices (its kernel reads tiles)")
    lq, lk = 11, 14
    mask = _catalogue(lq, lk, np.random.default_rng(1))[name]
    want = _truth(mask.bind(np, BATCH, HEADS, lq, lk), lq, lk)
    mask = mask.with_arrays([backend.asarray(np.asarray(a)) for a in mask.arrays])
    xp = backend.xp
    bound = mask.bind(xp, BATCH, HEADS, lq, lk)
    index = [backend.asarray(a) for a in (np.arange(2).reshape(2, 1, 1, 1),
                                            np.arange(HEADS).reshape(HEADS, 1, 1),
                                            np.arange(lq)[:, None], np.arange(lk)[None, :])]
    got = bound.allows(xp, *index, lq, lk)
    np.testing.assert_array_equal(np.broadcast_to(backend.to_numpy(got), want.shape), want)


@pytest.mark.parametrize("name", ["causal", "documents", "window_or_global", "dense", "function",
                                  "key_lengths", "global_tokens_per_batch"])
def test_the_nonfinite_helpers_find_the_rows_that_see_a_bad_key(name, backend):
    from portattn import nonfinite
    from portattn._inputs import describe

    if backend.name == "dask":
        pytest.skip("the helpers serve kernels with tiles on the host's loop (dask: chunks)")
    lq, lk, hkv = 300, 290, 1
    rng = np.random.default_rng(4)
    q = rng.standard_normal((*BATCH, HEADS, lq, 4))
    k, v = (rng.standard_normal((*BATCH, hkv, lk, 4)) for _ in range(2))
    bad = rng.random((*BATCH, hkv, lk)) < 0.01
    k[bad] = np.nan
    mask = _catalogue(lq, lk, rng)[name]
    want = (_truth(mask.bind(np, BATCH, HEADS, lq, lk), lq, lk)
            & np.repeat(bad, HEADS, axis=-2)[..., None, :]).any(axis=-1)
    mask = mask.with_arrays([backend.asarray(np.asarray(a)) for a in mask.arrays])
    xp = backend.xp
    q, k, v = (backend.asarray(a, "float32") for a in (q, k, v))
    inputs = describe(q, k, v, mask=mask)
    key, value, marked = nonfinite.clear_keys(xp, k, v)
    np.testing.assert_array_equal(backend.to_numpy(marked), bad)
    assert np.isfinite(backend.to_numpy(key)).all()
    assert np.isfinite(backend.to_numpy(value)).all()
    rows = nonfinite.rows_seeing(inputs, marked)
    np.testing.assert_array_equal(backend.to_numpy(rows), want)
    out = nonfinite.poison(xp, xp.ones((*BATCH, HEADS, lq, 2)), rows)
    np.testing.assert_array_equal(np.isnan(backend.to_numpy(out)).all(axis=-1), want)


def test_a_block_form_without_rows_visits_nothing():
    form = masks.block_mask(masks.key_lengths(np.zeros(0, int)).bind(np, (0,), 2, 8, 8),
                            8, 8, 4, 4)
    assert form.merged.shape == (2, 2)
    assert (form.merged == HIDDEN).all()
    assert form.kv_blocks(0) == []
