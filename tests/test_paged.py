"""Packed queries of many sequences against keys in pages (``portattn.paged_attention``
and ``portattn.PagedKVCache``): each sequence's rows equal attending its own keys alone
(the float64 oracle), whatever the page size, layout, mask or batch around it."""

from __future__ import annotations

import re

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.testing import assert_close, oracle
from portattn.testing.paged import scattered_pages
from portattn.testing.plugin import require_backend

# (queries, keys) per sequence: no query, a first token, decodes, a whole prompt, a
# prompt's second chunk, a prefill beside a long cache
SEQUENCES = [(0, 5), (1, 1), (1, 70), (37, 37), (20, 150), (1, 3), (5, 5)]
HQ, HKV, D, DV = 4, 2, 16, 8
#: The backends whose rows do not depend on the batch, bit for bit (docs/serving.md).
BATCH_INVARIANT = {"numpy", "torch", "array_api_strict", "dask"}

MASKS = {
    "none": None,
    "causal": masks.causal(),
    "window": masks.causal() & masks.sliding_window(5),
    "two_sided": masks.sliding_window(3, 2),
    "window_and_sinks": masks.causal() & (masks.sliding_window(4) | masks.sink_tokens(2)),
    "chunks": masks.causal() & masks.chunks(8),
}


def _pool(rng, sequences, page, layout, garbage=np.nan):
    """Keys and values of each sequence scattered over a pool whose other slots hold
    ``garbage``; returns (k_pool, v_pool, table, own keys and values per sequence)."""
    return scattered_pages(rng, [n for _, n in sequences], page, HKV, D, DV, layout=layout,
                           garbage=garbage, spare=3)


def _expected(q, sequences, own, **kwargs):
    """Each sequence's queries against its own keys, by the oracle, packed again."""
    outs, lses, start = [], [], 0
    per_sequence = {k: v for k, v in kwargs.items() if k in ("alibi_slopes", "sinks")}
    for s, (n, _) in enumerate(sequences):
        k, v = own[s]
        options = dict(kwargs)
        for name, value in per_sequence.items():
            options[name] = value[s] if value is not None and value.ndim == 2 else value
        out, lse, _ = oracle(q[start:start + n].transpose(1, 0, 2), k.transpose(1, 0, 2),
                             v.transpose(1, 0, 2), return_lse=True, **options)
        outs.append(out.transpose(1, 0, 2))
        lses.append(lse)
        start += n
    return np.concatenate(outs), np.concatenate(lses, axis=-1)


def _starts(sequences):
    return np.cumsum([0] + [n for n, _ in sequences]).astype(np.int32)


# every mask with pages of 16; every page size with the mask of most parts (a mask
# reads positions only, which the page size does not change)
CASES = [(16, name) for name in MASKS] + [(1, "window_and_sinks"), (64, "window_and_sinks")]


@pytest.mark.parametrize(("page", "mask"), CASES, ids=[f"{m}-{p}" for p, m in CASES])
def test_mixed_prefill_and_decode_equals_each_sequence_alone(backend, page, mask):
    rng = np.random.default_rng(page)
    k_pool, v_pool, table, own = _pool(rng, SEQUENCES, page, "blhd")
    q = rng.standard_normal((sum(n for n, _ in SEQUENCES), HQ, D)).astype(np.float32)
    lengths = np.array([n for _, n in SEQUENCES], dtype=np.int32)
    a = backend.asarray
    out, lse = portattn.paged_attention(
        a(q), a(k_pool), a(v_pool), block_table=a(table), key_lengths=a(lengths),
        query_starts=a(_starts(SEQUENCES)), mask=MASKS[mask], return_lse=True)
    want_out, want_lse = _expected(q, SEQUENCES, own, mask=MASKS[mask])
    assert out.shape == (q.shape[0], HQ, DV)
    assert lse.shape == (HQ, q.shape[0])
    assert_close(out, want_out, "float32")
    assert_close(lse, want_lse, "float32", "lse")


@pytest.mark.parametrize("sinks", [0, 4])
def test_tiles_that_start_reading_at_different_chunks(backend, sinks):
    """A window over long sequences: tiles begin at different chunks of keys (with no
    sink tokens), and sequences end at different ones."""
    rng = np.random.default_rng(7)
    sequences = [(1, 700), (70, 600), (3, 90), (1, 300)]
    k_pool, v_pool, table, own = _pool(rng, sequences, 16, "blhd")
    q = rng.standard_normal((sum(n for n, _ in sequences), HQ, D)).astype(np.float32)
    lengths = np.array([n for _, n in sequences], dtype=np.int32)
    mask = masks.causal() & (masks.sliding_window(100) | masks.sink_tokens(sinks))
    a = backend.asarray
    out = portattn.paged_attention(a(q), a(k_pool), a(v_pool), block_table=a(table),
                                   key_lengths=a(lengths), query_starts=a(_starts(sequences)),
                                   mask=mask)
    assert_close(out, _expected(q, sequences, own, mask=mask)[0], "float32")


@pytest.mark.parametrize("layout", ["blhd", "bhld"])
def test_score_changes_and_layouts(backend, layout):
    rng = np.random.default_rng(1)
    k_pool, v_pool, table, own = _pool(rng, SEQUENCES, 16, layout)
    q = rng.standard_normal((sum(n for n, _ in SEQUENCES), HQ, D)).astype(np.float32)
    lengths = np.array([n for _, n in SEQUENCES], dtype=np.int32)
    slopes = rng.uniform(0.1, 1.0, (len(SEQUENCES), HQ)).astype(np.float32)
    sinks = rng.standard_normal(HQ).astype(np.float32)
    options = {"mask": masks.causal(), "softcap": 3.0, "scale": 0.4}
    a = backend.asarray
    out, lse = portattn.paged_attention(
        a(q), a(k_pool), a(v_pool), block_table=a(table), key_lengths=a(lengths),
        query_starts=a(_starts(SEQUENCES)), alibi_slopes=a(slopes), sinks=a(sinks),
        return_lse=True, layout=layout, **options)
    want_out, want_lse = _expected(q, SEQUENCES, own, alibi_slopes=slopes, sinks=sinks,
                                   **options)
    assert_close(out, want_out, "float32")
    assert_close(lse, want_lse, "float32", "lse")


def test_a_row_that_sees_no_key_gives_zero_and_minus_infinity(backend):
    rng = np.random.default_rng(2)
    sequences = [(2, 6)]  # positions 4 and 5: chunk 1, where no sink token lies
    k_pool, v_pool, table, _ = _pool(rng, sequences, 4, "blhd")
    q = rng.standard_normal((2, HQ, D)).astype(np.float32)
    a = backend.asarray
    out, lse = portattn.paged_attention(
        a(q), a(k_pool), a(v_pool), block_table=a(table),
        key_lengths=a(np.array([6], dtype=np.int32)), query_starts=a(_starts(sequences)),
        mask=masks.chunks(4) & masks.sink_tokens(2), return_lse=True)
    np.testing.assert_array_equal(backend.to_numpy(out), 0)
    assert np.all(np.isneginf(backend.to_numpy(lse)))


def test_a_non_finite_value_reaches_only_the_rows_that_attend_it(backend):
    rng = np.random.default_rng(3)
    sequences = [(4, 8)]
    k_pool, v_pool, table, own = _pool(rng, sequences, 4, "blhd", garbage=0.0)
    v_pool[table[0, 1], 1, 0, 0] = np.inf  # key 5, which query positions 5.. attend
    own[0][1][5, 0, 0] = np.inf
    q = rng.standard_normal((4, HQ, D)).astype(np.float32)
    a = backend.asarray
    out = backend.to_numpy(portattn.paged_attention(
        a(q), a(k_pool), a(v_pool), block_table=a(table),
        key_lengths=a(np.array([8], dtype=np.int32)), query_starts=a(_starts(sequences)),
        mask=masks.causal()))
    assert np.all(np.isfinite(out[:1]))  # position 4 does not see key 5
    assert np.all(np.isnan(out[1:, :2, 0]))  # heads of KV head 0, from position 5 on
    assert np.all(np.isfinite(out[1:, 2:]))


def test_a_query_whose_every_score_is_nan_gives_nan(backend):
    """A NaN query scores NaN against every key it sees, so no score is a largest one:
    its row is NaN, not the zeros of a row that saw nothing."""
    rng = np.random.default_rng(5)
    sequences = [(3, 7), (1, 5)]
    k_pool, v_pool, table, _ = _pool(rng, sequences, 4, "blhd", garbage=0.0)
    q = rng.standard_normal((4, HQ, D)).astype(np.float32)
    q[1, 0] = np.nan  # the second query of the first sequence, query head 0
    a = backend.asarray
    out, lse = (backend.to_numpy(x) for x in portattn.paged_attention(
        a(q), a(k_pool), a(v_pool), block_table=a(table),
        key_lengths=a(np.array([7, 5], dtype=np.int32)), query_starts=a(_starts(sequences)),
        mask=masks.causal(), return_lse=True))
    assert np.all(np.isnan(out[1, 0]))
    finite = np.ones(out.shape[:2], dtype=bool)
    finite[1, 0] = False
    assert np.all(np.isfinite(out[finite]))
    assert np.all(np.isfinite(lse.T[finite]))


def test_scores_that_overflow_the_dtype_keep_the_rule(backend):
    """float32 scores past its largest value are infinities, as in every other call:
    ``+inf`` makes its row NaN, ``-inf`` gives its key weight 0."""
    rng = np.random.default_rng(6)
    sequences = [(2, 6)]
    k_pool, v_pool, table, own = _pool(rng, sequences, 4, "blhd", garbage=0.0)
    q = np.zeros((2, HQ, D), dtype=np.float32)
    q[:, :, 0] = 1e30
    key = own[0][0]  # (6, HKV, D): the sequence's keys in order
    k_pool[table[0, 0], 1, 0, 0] = -1e30  # key 1 of KV head 0: a score of -inf
    k_pool[table[0, 1], 0, 1, 0] = 1e30  # key 4 of KV head 1: +inf
    key[1, 0, 0], key[4, 1, 0] = -1e30, 1e30
    a = backend.asarray
    with np.errstate(all="ignore"):  # NumPy-based kernels warn about overflow, by design
        out = backend.to_numpy(portattn.paged_attention(
            a(q), a(k_pool), a(v_pool), block_table=a(table),
            key_lengths=a(np.array([6], dtype=np.int32)), query_starts=a(_starts(sequences))))
    assert np.all(np.isnan(out[:, 2:]))  # query heads of KV head 1 see key 4
    # KV head 0's rows: every key but key 1, whose scores overflowed to -inf
    rest = [0, 2, 3, 4, 5]
    expected = portattn.attention(
        q[None, :, :2].transpose(0, 2, 1, 3).astype(np.float64),
        key[None, rest, :1].transpose(0, 2, 1, 3).astype(np.float64),
        own[0][1][None, rest, :1].transpose(0, 2, 1, 3).astype(np.float64),
        kernel="reference")
    np.testing.assert_allclose(out[:, :2], expected[0].transpose(1, 0, 2), rtol=1e-5)


def test_a_cache_serves_prompts_forks_and_decodes(backend):
    """Prompts of several lengths in one packed batch, a fork that shares its parent's
    pages (copy on write of the partial last page), then decode steps that mix
    sequences; every step equals each sequence's own causal attention."""
    rng = np.random.default_rng(4)
    cache = portattn.PagedKVCache.empty(4, HKV, D, value_head_dim=DV, num_pages=2,
                                        xp=backend.xp, device=backend.device)
    mine: dict[int, tuple[list, list]] = {}

    def step(sequences, counts):
        total = sum(counts)
        k = rng.standard_normal((total, HKV, D)).astype(np.float32)
        v = rng.standard_normal((total, HKV, DV)).astype(np.float32)
        q = rng.standard_normal((total, HQ, D)).astype(np.float32)
        cache.append(sequences, backend.asarray(k), backend.asarray(v), counts)
        start = 0
        expected = []
        for s, n in zip(sequences, counts, strict=True):
            keys, values = mine.setdefault(s, ([], []))
            keys.extend(k[start:start + n])
            values.extend(v[start:start + n])
            want, _, _ = oracle(q[start:start + n].transpose(1, 0, 2),
                                np.stack(keys).transpose(1, 0, 2),
                                np.stack(values).transpose(1, 0, 2), mask=masks.causal())
            expected.append(want.transpose(1, 0, 2))
            start += n
        got = cache.attention(backend.asarray(q), sequences, counts, mask=masks.causal())
        assert_close(got, np.concatenate(expected), "float32")

    a, b = cache.add(), cache.add()
    step([a, b], [6, 9])
    c = cache.fork(a)
    mine[c] = (list(mine[a][0]), list(mine[a][1]))
    assert cache.pages_in_use == 2 + 3  # a's two pages are shared with c
    step([a, c], [1, 1])  # a copies the shared partial page, c then owns the original
    assert cache.pages_in_use == 6
    d = cache.add()
    step([b, c, d], [1, 3, 7])
    for _ in range(3):
        step([a, b, c, d], [1, 1, 1, 1])
    assert [cache.length(s) for s in (a, b, c, d)] == [10, 13, 13, 10]
    for s in (a, b, c, d):
        cache.free(s)
    assert cache.pages_in_use == 0


@pytest.mark.parametrize("mask", ["causal", "window"])
def test_a_shared_prompt_is_read_once_with_cascade(backend, mask, monkeypatch):
    """Four samples of one prompt and an unrelated sequence decode together: with a
    causal mask the prompt's full pages are attended once for all four samples (a
    window might hide some of them: no cascade), and every row equals the oracle."""
    import portattn._kernels._cascade as cascade

    groups, merges = [], []
    find, merge = cascade.shared_prefixes, cascade.merge
    monkeypatch.setattr(cascade, "shared_prefixes",
                        lambda call: groups.append(find(call)) or groups[-1])
    monkeypatch.setattr(cascade, "merge", lambda *a: merges.append(1) or merge(*a))
    rng = np.random.default_rng(8)
    cache = portattn.PagedKVCache.empty(4, HKV, D, value_head_dim=DV, xp=backend.xp,
                                        device=backend.device)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    prompt_k, prompt_v, other_k, other_v = normal(38, HKV, D), normal(38, HKV, DV), \
        normal(5, HKV, D), normal(5, HKV, DV)
    first, other = cache.add(), cache.add()
    cache.append([first, other], backend.asarray(np.concatenate([prompt_k, other_k])),
                 backend.asarray(np.concatenate([prompt_v, other_v])), [38, 5])
    samples = [first] + [cache.fork(first) for _ in range(3)]
    mine = {s: (list(prompt_k), list(prompt_v)) for s in samples}
    mine[other] = (list(other_k), list(other_v))
    options = {"mask": MASKS[mask], "softcap": 5.0,
               "sinks": backend.asarray(normal(HQ))}
    for step in range(2):
        order = [*samples, other]
        counts = [1, 1, 2, 1, 1] if step else [1] * 5
        k, v, q = normal(sum(counts), HKV, D), normal(sum(counts), HKV, DV), \
            normal(sum(counts), HQ, D)
        cache.append(order, backend.asarray(k), backend.asarray(v), counts)
        groups.clear()
        merges.clear()
        got = cache.attention(backend.asarray(q), order, counts, cascade=True, **options)
        # the prompt's 9 full pages (the partial 10th was copied on write), shared by
        # the four samples, read in a pass of their own and merged where a window
        # cannot hide them
        assert groups == [[([0, 1, 2, 3], 9)]]  # the samples, first in the call
        assert len(merges) == (mask == "causal")
        want, start = [], 0
        for s, n in zip(order, counts, strict=True):
            keys, values = mine[s]
            keys.extend(k[start:start + n])
            values.extend(v[start:start + n])
            out, _, _ = oracle(q[start:start + n].transpose(1, 0, 2),
                               np.stack(keys).transpose(1, 0, 2),
                               np.stack(values).transpose(1, 0, 2), mask=MASKS[mask],
                               softcap=5.0, sinks=backend.to_numpy(options["sinks"]))
            want.append(out.transpose(1, 0, 2))
            start += n
        assert_close(got, np.concatenate(want), "float32")


def test_no_query_gives_empty_results(backend):
    cache = portattn.PagedKVCache.empty(4, HKV, D, value_head_dim=DV, xp=backend.xp,
                                        device=backend.device)
    q = backend.asarray(np.zeros((0, HQ, D), dtype=np.float32))
    out, lse = cache.attention(q, [], return_lse=True)
    assert out.shape == (0, HQ, DV)
    assert lse.shape == (HQ, 0)


def test_the_pool_grows_with_the_pages_in_use_and_reuses_freed_ones(backend):
    cache = portattn.PagedKVCache.empty(16, 1, 8, num_pages=1, xp=backend.xp,
                                        device=backend.device)
    new = backend.asarray(np.ones((40, 1, 8), dtype=np.float32))
    a = cache.add()
    cache.append([a], new, new, [40])  # 3 pages
    assert (cache.pages_in_use, cache.num_pages) == (3, 4)
    cache.free(a)
    b = cache.add()
    cache.append([b], new, new, [40])
    assert (cache.pages_in_use, cache.num_pages) == (3, 4)


@pytest.mark.parametrize("others", [1, 5, 31])
def test_a_sequence_gives_the_same_bits_whatever_shares_its_batch(backend, others):
    if backend.name not in BATCH_INVARIANT:
        pytest.skip(f"{backend.name} is not batch invariant: its paged kernel's shapes "
                    "follow the whole batch (docs/serving.md)")
    rng = np.random.default_rng(5)
    sequences = [(1, 300)] + [(int(rng.integers(1, 3)), int(rng.integers(3, 400)))
                              for _ in range(others)]
    k_pool, v_pool, table, _ = _pool(rng, sequences, 16, "blhd")
    q = rng.standard_normal((sum(n for n, _ in sequences), HQ, D)).astype(np.float32)
    lengths = np.array([n for _, n in sequences], dtype=np.int32)
    a = backend.asarray

    def run(count):
        return backend.to_numpy(portattn.paged_attention(
            a(q[:_starts(sequences)[count]]), a(k_pool), a(v_pool),
            block_table=a(table[:count]), key_lengths=a(lengths[:count]),
            query_starts=a(_starts(sequences[:count])), mask=masks.causal()))

    np.testing.assert_array_equal(run(1)[0], run(len(sequences))[0])


def test_absorbed_latent_attention_shapes(backend):
    """One key/value head with key dim 576 and value dim 512 (an absorbed MLA decode)."""
    rng = np.random.default_rng(6)
    sequences = [(1, 40), (1, 9), (3, 20)]
    page, width = 16, 3
    k_pool = rng.standard_normal((8, page, 1, 576)).astype(np.float32)
    v_pool = k_pool[..., :512].copy()
    table = np.array([[3, 0, 5], [6, -1, -1], [1, 7, -1]], dtype=np.int32)
    q = rng.standard_normal((5, 8, 576)).astype(np.float32)
    lengths = np.array([n for _, n in sequences], dtype=np.int32)
    a = backend.asarray
    out = portattn.paged_attention(a(q), a(k_pool), a(v_pool), block_table=a(table),
                                   key_lengths=a(lengths),
                                   query_starts=a(_starts(sequences)), mask=masks.causal(),
                                   scale=0.05)
    own = [(k_pool[table[s, :width]].reshape(-1, 1, 576)[:n],
            v_pool[table[s, :width]].reshape(-1, 1, 512)[:n])
           for s, (_, n) in enumerate(sequences)]
    want, _ = _expected(q, sequences, own, mask=masks.causal(), scale=0.05)
    assert out.shape == (5, 8, 512)
    assert_close(out, want, "float32")


def _call(**changes):
    q = np.zeros((3, 4, 8), dtype=np.float32)
    pool = np.zeros((4, 2, 2, 8), dtype=np.float32)
    args = {"query": q, "key_pages": pool, "value_pages": pool,
            "block_table": np.array([[0, 1], [2, -1]]), "key_lengths": np.array([3, 2]),
            "query_starts": np.array([0, 1, 3])}
    args.update(changes)
    return portattn.paged_attention(args.pop("query"), args.pop("key_pages"),
                                    args.pop("value_pages"), **args)


@pytest.mark.parametrize(("changes", "text"), [
    ({"key_lengths": np.array([3, 5])},
     "key_lengths must lie in [0, block_table.shape[1] * page=4]; got key_lengths[1]=5"),
    ({"query_starts": np.array([0, 1, 4])},
     "query_starts must run from 0 to query.shape[0]=3; got query_starts[0]=0, "
     "query_starts[-1]=4"),
    ({"key_lengths": np.array([3, 1])}, "sequence 1 has 2 queries, which must lie in "
                                        "[0, key_lengths[1]=1]"),
    ({"block_table": np.array([[0, 1], [9, -1]])},
     "block_table[1] names pages outside the pool of 4 within the sequence's "
     "key_lengths[1]=2; got pages [9]"),
    ({"block_table": np.array([[0.0, 1.0], [2.0, 3.0]])},
     "block_table must be an integer array with 2 dims"),
    ({"mask": masks.documents(np.zeros(3, dtype=np.int32))},
     "mask must read positions alone"),
    ({"mask": masks.causal("top_left")}, "mask must read positions alone"),
    ({"query_starts": None}, "without query_starts, query holds one query per sequence; "
                             "got query.shape[0]=3 for 2 sequences"),
    ({"alibi_slopes": np.ones(3, dtype=np.float32)},
     "alibi_slopes must have shape (Hq,)=(4,) or (S, Hq)=(2, 4); got alibi_slopes.shape=(3,)"),
    ({"layout": "lbhd"}, "layout must be one of ('blhd', 'bhld'); got layout='lbhd'"),
    ({"softcap": 0.0}, "softcap must be > 0 or None; got softcap=0.0"),
])
def test_bad_paged_calls_name_the_argument(changes, text):
    with pytest.raises(ValueError, match=re.escape(text)):
        _call(**changes)


def test_a_pool_of_another_dtype_is_refused():
    with pytest.raises(TypeError, match=re.escape("key_pages.dtype=float64 differs from "
                                                  "query.dtype=float32")):
        _call(key_pages=np.zeros((4, 2, 2, 8)))
    with pytest.raises(TypeError, match=re.escape("query must hold real floating values; "
                                                  "got query.dtype=int64")):
        _call(query=np.zeros((3, 4, 8), dtype=np.int64))


@pytest.mark.parametrize(("action", "text"), [
    (lambda c, s: c.append([s, s], *[np.zeros((2, 1, 4), np.float32)] * 2),
     "each sequence may appear once; got sequences=[0, 0]"),
    (lambda c, s: c.append([s], *[np.zeros((2, 1, 4), np.float32)] * 2, [3]),
     "counts must give one number per sequence, summing to key.shape[0]"),
    (lambda c, s: c.append([s], *[np.zeros((1, 2, 4), np.float32)] * 2),
     "key must have shape ('T', 1, 4); got key.shape=(1, 2, 4)"),
    (lambda c, s: c.fork(7), "sequence 7 is not in the cache (live: [0])"),
])
def test_bad_cache_calls_name_the_argument(action, text):
    cache = portattn.PagedKVCache.empty(4, 1, 4)
    seq = cache.add()
    with pytest.raises(ValueError, match=re.escape(text)):
        action(cache, seq)
    assert cache.length(seq) == 0
    assert cache.pages_in_use == 0


def _plan(**changes):
    q = np.zeros((4, 2, 8), dtype=np.float32)
    pool = np.zeros((8, 4, 2, 8), dtype=np.float32)
    args = {"block_table": np.array([[0, 1, 3], [0, 1, 4], [5, 6, -1]]),
            "key_lengths": np.array([11, 12, 6]), "query_starts": np.array([0, 1, 2, 4]),
            "return_lse": True, "cascade": True}
    args.update(changes)
    return portattn.explain_paged(q, pool, pool, **args)


def test_explain_paged_names_the_kernel_that_runs_the_call_and_why_not_the_others():
    plan = _plan(mask=masks.causal())
    text = str(plan)
    assert "3 sequences, 4 queries (2 decoding one token, 1 with more, 0 with none), keys " \
           "per sequence 6 to 12" in text
    assert "cascade=True would: read 2 pages among sequences [0, 1] once" in text
    chosen = plan.kernel
    entries = [entry for entry, _ in plan.candidates]
    before = plan.candidates[:entries.index(chosen)] if chosen else plan.candidates
    assert all(why for _, why in before)  # the first kernel that can, in dispatch order
    assert "tiled (portattn" in text
    assert "paged calls not supported" in text
    with portattn.disable_kernels(*(e.name for e, why in plan.candidates if not why)):
        alone = _plan(mask=masks.causal())
    assert alone.kernel is None
    assert str(alone).startswith("kernel: the portable loop")
    if chosen is not None:
        assert "disabled by portattn.disable_kernels()" in str(alone)


def test_a_kernel_that_defers_leaves_the_call_to_the_kernel_it_names(monkeypatch):
    from portattn._dispatch import paged_kernel
    from portattn._kernels import ReferenceKernel, TiledKernel

    # two kernels that take the call, tiled first in dispatch order and deferring
    for kernel in (TiledKernel, ReferenceKernel):
        monkeypatch.setattr(kernel, "paged", True)
    able = [e.name for e, why in _plan().candidates if not why]
    monkeypatch.setattr(TiledKernel, "paged_defers_to",
                        classmethod(lambda cls, call: ("no_such_kernel", "reference")))
    with portattn.disable_kernels(*able[:able.index("tiled")]):  # those before tiled
        plan = _plan()
        assert plan.kernel.name == "reference"
        assert paged_kernel(plan.call) is plan.kernel.kernel
        assert dict((e.name, why) for e, why in plan.candidates)["tiled"] == (
            "passed over: defers to reference",)
        with portattn.disable_kernels("reference"):  # none it names can: it runs
            assert _plan().kernel.name == "tiled"


@pytest.mark.parametrize(("changes", "says"), [
    ({"alibi_slopes": np.ones(2, dtype=np.float32)}, "nothing: alibi_slopes"),
    ({"mask": masks.sliding_window(3)}, "nothing: mask=sliding_window"),
    ({"block_table": np.array([[0, 1, 3], [2, 1, 4], [5, 6, -1]])},
     "nothing: no two sequences with queries begin with the same full pages"),
])
def test_explain_paged_says_when_cascade_shares_nothing(changes, says):
    assert f"cascade=True would: {says}" in str(_plan(**changes))


def test_explain_paged_checks_its_arguments_as_the_call_does():
    with pytest.raises(ValueError, match=re.escape("key_lengths must lie in")):
        _plan(key_lengths=np.array([11, 12, 99]))
    with pytest.raises(TypeError, match=re.escape("unexpected keyword arguments ['kernel']")):
        _plan(kernel="tiled")
    with pytest.raises(TypeError, match="needs key_lengths="):
        portattn.explain_paged(np.zeros((1, 2, 8)), np.zeros((1, 4, 2, 8)),
                               np.zeros((1, 4, 2, 8)), block_table=np.zeros((1, 1), int))


def test_a_traced_call_left_to_the_portable_loop_names_the_traced_arguments():
    """Under jax.jit the portable loop cannot plan its query tiles on the host: a clear
    error naming what is traced (here the table and lengths; the starts are concrete)."""
    jax_backend = require_backend("jax")
    import jax

    a = jax_backend.asarray
    q = np.zeros((3, 4, 8), dtype=np.float32)
    pool = np.zeros((4, 2, 2, 8), dtype=np.float32)
    table, lengths = np.array([[0, 1], [2, -1]]), np.array([3, 2])
    starts = a(np.array([0, 1, 3]))

    def attend(q, pool, table, lengths):
        options = {"block_table": table, "key_lengths": lengths, "query_starts": starts}
        plan = portattn.explain_paged(q, pool, pool, **options)
        assert "block_table, key_lengths traced: the query tiles are planned on the " \
               "device" in str(plan)
        assert plan.call.host_plan_reason() == ("block_table, key_lengths traced (this "
                                                "kernel plans the call on the host)")
        with portattn.disable_kernels(*(e.name for e, why in plan.candidates if not why)):
            return portattn.paged_attention(q, pool, pool, **options)

    text = ("a paged call's query tiles are planned on the host here, from block_table "
            "and key_lengths; got traced values (under jax.jit or torch.compile)")
    with pytest.raises(ValueError, match=re.escape(text)):
        jax.eval_shape(attend, a(q), a(pool), a(table), a(lengths))
