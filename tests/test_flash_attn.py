"""flash-attn's call shapes (portattn.flash_attn) against a float64 NumPy oracle that
attends each sequence alone, written from flash-attn's documented semantics: the
queries of a sequence aligned to the end of its keys, ``window_size`` ``(left,
right)`` with -1 unbounded, softcap before ALiBi's ``-slope * |p - j|``."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from array_api_compat import is_writeable_array

import portattn
from portattn import masks
from portattn.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
from portattn.testing import assert_close, to_numpy

HQ, HKV, D = 4, 2, 8


def reference(q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0,
              slopes=None):
    """``(out (n, Hq, Dv), lse (Hq, n))`` of one sequence, in float64."""
    q, k, v = (np.asarray(to_numpy(a), dtype=np.float64) for a in (q, k, v))
    n, m = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("ihd,jhd->hij", q, k) * (1 / math.sqrt(q.shape[-1]) if scale is None
                                           else scale)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    p = (m - n + np.arange(n))[:, None]
    j = np.arange(m)[None, :]
    if slopes is not None:
        s = s - np.asarray(to_numpy(slopes), np.float64)[:, None, None] * np.abs(p - j)
    left, right = window
    right = 0 if causal else right
    allowed = np.ones((n, m), dtype=bool)
    if left >= 0:
        allowed &= j >= p - left
    if right >= 0:
        allowed &= j <= p + right
    s = np.where(allowed, s, -np.inf)
    top = s.max(axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(s - top)
    total = e.sum(axis=-1, keepdims=True)
    lse = np.where(total > 0, np.log(np.where(total > 0, total, 1)) + top, -np.inf)
    out = np.einsum("hij,jhd->ihd", e / np.where(total > 0, total, 1), v)
    return out, lse[..., 0]


def expected(q, k, v, cu_q, spans, *, slopes=None, **options):
    """The oracle per sequence: queries ``cu_q[s]:cu_q[s+1]``, keys ``k[a:a+n]`` for
    ``spans[s] == (a, n)``."""
    outs, lses = [], []
    for s, (a, n) in enumerate(spans):
        rows = slice(cu_q[s], cu_q[s + 1])
        one = None if slopes is None else (slopes[s] if slopes.ndim == 2 else slopes)
        out, lse = reference(q[rows], k[a:a + n], v[a:a + n], slopes=one, **options)
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses, axis=1)


def packed(q_lens, k_lens, *, seed=0, dv=D):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sum(q_lens), HQ, D)).astype(np.float32)
    k = rng.standard_normal((sum(k_lens), HKV, D)).astype(np.float32)
    v = rng.standard_normal((sum(k_lens), HKV, dv)).astype(np.float32)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    return q, k, v, cu_q, cu_k


def paged_pools(k, v, cu_k, page, *, seed=1):
    """The keys of each sequence moved into pages of ``page`` tokens of a shuffled pool
    (with spare pages holding NaN, which no sequence reads)."""
    rng = np.random.default_rng(seed)
    lengths = np.diff(cu_k)
    need = [-(-int(n) // page) for n in lengths]
    width = max(max(need), 1)
    pages = sum(need) + 3
    order = rng.permutation(pages)
    kp = np.full((pages, page, *k.shape[1:]), np.nan, dtype=k.dtype)
    vp = np.full((pages, page, *v.shape[1:]), np.nan, dtype=v.dtype)
    table = np.full((len(lengths), width), -1, dtype=np.int32)
    taken = 0
    for s in range(len(lengths)):
        for i in range(need[s]):
            p = order[taken]
            taken += 1
            table[s, i] = p
            rows = slice(cu_k[s] + i * page, min(cu_k[s] + (i + 1) * page, cu_k[s + 1]))
            count = rows.stop - rows.start
            kp[p, :count], vp[p, :count] = k[rows], v[rows]
    return kp, vp, table


OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window-both-sides": {"window_size": (2, 1)},
    "window-right-only": {"window_size": (-1, 2)},
    "causal-window": {"causal": True, "window_size": (3, -1)},
    "softcap-causal": {"causal": True, "softcap": 0.5},
    "scale": {"softmax_scale": 0.9},
    "alibi-causal": {"causal": True, "slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
    "alibi-per-sequence-window": {
        "window_size": (2, 2),
        "slopes": np.linspace(0.05, 0.8, 4 * HQ).reshape(4, HQ)},
}


def split(options):
    """(keyword arguments of the call, of the oracle)."""
    call = {k: v for k, v in options.items() if k != "slopes"}
    oracle = {"causal": options.get("causal", False),
              "window": options.get("window_size", (-1, -1)),
              "scale": options.get("softmax_scale"), "softcap": options.get("softcap", 0.0),
              "slopes": options.get("slopes")}
    return call, oracle


@pytest.mark.parametrize("name", list(OPTIONS))
def test_varlen_equals_each_sequence_alone(backend, name):
    # four sequences: a prompt end, no query at all, a decode step, as many as keys
    q_lens, k_lens = [3, 0, 1, 5], [7, 4, 6, 5]
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens)
    call, options = split(OPTIONS[name])
    slopes = options.pop("slopes")
    a = backend.asarray
    out, lse, probs = flash_attn_varlen_func(
        a(q), a(k), a(v), a(cu_q), a(cu_k), 5, 7, return_attn_probs=True,
        alibi_slopes=None if slopes is None else a(slopes.astype(np.float32)), **call)
    want_out, want_lse = expected(q, k, v, cu_q, list(zip(cu_k, k_lens, strict=False)),
                                  slopes=slopes, **options)
    assert probs is None
    assert tuple(lse.shape) == (HQ, sum(q_lens))
    assert_close(out, want_out, "float32")
    assert_close(lse, want_lse, "float32", "lse")


@pytest.mark.parametrize("name", ["plain", "causal", "window-both-sides", "alibi-causal",
                                  "alibi-per-sequence-window"])
def test_sequences_with_more_queries_than_keys(backend, name):
    # query i of n sits at m - n + i: under causal the first ones see no key (0, -inf)
    q_lens, k_lens = [1, 4, 2, 3], [6, 2, 0, 3]
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, seed=2)
    call, options = split(OPTIONS[name])
    slopes = options.pop("slopes")
    a = backend.asarray
    out, lse, _ = flash_attn_varlen_func(
        a(q), a(k), a(v), a(cu_q), a(cu_k), 4, 6, return_attn_probs=True,
        alibi_slopes=None if slopes is None else a(slopes.astype(np.float32)), **call)
    want_out, want_lse = expected(q, k, v, cu_q, list(zip(cu_k, k_lens, strict=False)),
                                  slopes=slopes, **options)
    assert_close(out, want_out, "float32")
    assert_close(lse, want_lse, "float32", "lse")


def test_no_query_at_all(backend):
    q, k, v, cu_q, cu_k = packed([0, 0], [3, 2])
    a = backend.asarray
    out, lse, _ = flash_attn_varlen_func(a(q), a(k), a(v), a(cu_q), a(cu_k), 0, 3,
                                         causal=True, return_attn_probs=True)
    assert tuple(out.shape) == (0, HQ, D)
    assert tuple(lse.shape) == (HQ, 0)
    _, k_cache, v_cache, _, _ = cache_case()
    out, lse = flash_attn_with_kvcache(a(np.zeros((3, 0, HQ, D), np.float32)), a(k_cache),
                                       a(v_cache), cache_seqlens=2, return_softmax_lse=True)
    assert tuple(out.shape) == (3, 0, HQ, D)
    assert tuple(lse.shape) == (3, HQ, 0)


def test_the_oracle_agrees_with_portattn_attention():
    q, k, v, _, _ = packed([5], [9], seed=3)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    out, lse = reference(q, k, v, window=(3, 1), softcap=2.0, slopes=slopes)
    want, want_lse = portattn.attention(
        q[None].astype(np.float64), k[None].astype(np.float64), v[None].astype(np.float64),
        mask=masks.sliding_window(3, 1), softcap=2.0, alibi_slopes=slopes,
        return_lse=True, layout="blhd")
    np.testing.assert_allclose(out, want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse[0], rtol=1e-12, atol=1e-12)


def test_seqused_k_takes_the_first_keys(backend):
    q_lens, k_lens, used = [2, 1, 3], [6, 4, 5], [3, 4, 5]
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, seed=4)
    a = backend.asarray
    out = flash_attn_varlen_func(a(q), a(k), a(v), a(cu_q), a(cu_k), 3, 5, causal=True,
                                 seqused_k=a(np.array(used, np.int32)))
    want, _ = expected(q, k, v, cu_q, list(zip(cu_k, used, strict=False)), causal=True)
    assert_close(out, want, "float32")


@pytest.mark.parametrize("page", [1, 16])
def test_paged_varlen_equals_contiguous(backend, page):
    q_lens, k_lens = [3, 0, 1, 20, 2], [7, 4, 33, 20, 2]
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, seed=5, dv=6)
    kp, vp, table = paged_pools(k, v, cu_k, page)
    a = backend.asarray
    out, lse, _ = flash_attn_varlen_func(
        a(q), a(kp), a(vp), a(cu_q), a(cu_k), 20, 33, causal=True, window_size=(9, -1),
        return_attn_probs=True, block_table=a(table))
    want_out, want_lse = expected(q, k, v, cu_q, list(zip(cu_k, k_lens, strict=False)),
                                  causal=True, window=(9, -1))
    assert tuple(out.shape) == (sum(q_lens), HQ, 6)
    assert_close(out, want_out, "float32")
    assert_close(lse, want_lse, "float32", "lse")
    # seqused_k shortens each sequence's keys in its pages
    used = np.array([5, 0, 30, 20, 2], np.int32)
    out = flash_attn_varlen_func(a(q), a(kp), a(vp), a(cu_q), a(cu_k), 20, 33, causal=True,
                                 block_table=a(table), seqused_k=a(used))
    want, _ = expected(q, k, v, cu_q, list(zip(cu_k, used, strict=False)), causal=True)
    assert_close(out, want, "float32")


def test_half_precision(backend):
    if "float16" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float16")
    q, k, v, cu_q, cu_k = packed([3, 1], [5, 6], seed=6)
    a = backend.asarray
    out, lse, _ = flash_attn_varlen_func(a(q, "float16"), a(k, "float16"), a(v, "float16"),
                                         a(cu_q), a(cu_k), 3, 6, causal=True,
                                         return_attn_probs=True)
    assert str(out.dtype).endswith("float16")
    assert str(lse.dtype).endswith("float32")
    q, k, v = (a.astype(np.float16) for a in (q, k, v))
    want_out, want_lse = expected(q, k, v, cu_q, list(zip(cu_k, [5, 6], strict=False)),
                                  causal=True)
    assert_close(out, want_out, "float16")
    assert_close(lse, want_lse, "float16", "lse")


def cache_case(seed=7, batch=3, capacity=12, lq=2, lnew=2, dv=D):
    rng = np.random.default_rng(seed)
    k_cache = rng.standard_normal((batch + 1, capacity, HKV, D)).astype(np.float32)
    v_cache = rng.standard_normal((batch + 1, capacity, HKV, dv)).astype(np.float32)
    q = rng.standard_normal((batch, lq, HQ, D)).astype(np.float32)
    k = rng.standard_normal((batch, lnew, HKV, D)).astype(np.float32)
    v = rng.standard_normal((batch, lnew, HKV, dv)).astype(np.float32)
    return q, k_cache, v_cache, k, v


def kvcache_expected(q, keys, values, **options):
    """The oracle of each batch element: ``keys[b]`` ``(m_b, Hkv, D)``."""
    outs, lses = zip(*(reference(q[b], keys[b], values[b], **options)
                       for b in range(q.shape[0])), strict=True)
    return np.stack(outs), np.stack(lses)


def writeable(backend):
    return is_writeable_array(backend.asarray(np.zeros(1, np.float32)))


def test_kvcache_appends_in_place(backend):
    if not writeable(backend):
        pytest.skip(f"{backend.name} arrays are immutable")
    q, k_cache, v_cache, k, v = cache_case()
    held = np.array([5, 0, 9], np.int32)
    index = np.array([3, 0, 1], np.int32)          # cache rows of the batch elements
    a = backend.asarray
    kc, vc = a(k_cache), a(v_cache)
    out, lse = flash_attn_with_kvcache(a(q), kc, vc, a(k), a(v), cache_seqlens=a(held),
                                       cache_batch_idx=a(index), causal=True,
                                       return_softmax_lse=True)
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for b, (row, n) in enumerate(zip(index, held, strict=True)):
        want_k[row, n:n + 2], want_v[row, n:n + 2] = k[b], v[b]
    np.testing.assert_array_equal(to_numpy(kc), want_k)   # the rest is untouched
    np.testing.assert_array_equal(to_numpy(vc), want_v)
    want_out, want_lse = kvcache_expected(
        q, [want_k[r, :n + 2] for r, n in zip(index, held, strict=True)],
        [want_v[r, :n + 2] for r, n in zip(index, held, strict=True)], causal=True)
    assert tuple(lse.shape) == (3, HQ, 2)
    assert_close(out, want_out, "float32")
    assert_close(lse, want_lse, "float32", "lse")


def test_kvcache_writes_through_a_view(backend):
    if not writeable(backend):
        pytest.skip(f"{backend.name} arrays are immutable")
    xp = backend.xp
    q, k_cache, v_cache, k, v = cache_case(seed=8, batch=2, lq=1, lnew=1)
    # caches held head-major and seen as (B, L, H, D): not contiguous
    kc = xp.permute_dims(backend.asarray(np.ascontiguousarray(k_cache.transpose(0, 2, 1, 3))),
                         (0, 2, 1, 3))
    vc = xp.permute_dims(backend.asarray(np.ascontiguousarray(v_cache.transpose(0, 2, 1, 3))),
                         (0, 2, 1, 3))
    a = backend.asarray
    out = flash_attn_with_kvcache(a(q), kc, vc, a(k), a(v), cache_seqlens=4)
    np.testing.assert_array_equal(to_numpy(kc)[:2, 4], k[:, 0])
    np.testing.assert_array_equal(to_numpy(vc)[:2, 4], v[:, 0])
    want, _ = kvcache_expected(q, to_numpy(kc)[:2, :5], to_numpy(vc)[:2, :5])
    assert_close(out, want, "float32")


def test_kvcache_without_new_keys(backend):
    # reading only: immutable arrays (JAX) work too
    q, k_cache, v_cache, _, _ = cache_case(seed=9, lq=3)
    a = backend.asarray
    held = np.array([4, 12, 3], np.int32)
    out = flash_attn_with_kvcache(a(q), a(k_cache), a(v_cache), cache_seqlens=a(held),
                                  window_size=(2, -1), causal=True, num_splits=4)
    want, _ = kvcache_expected(q, [k_cache[b, :n] for b, n in enumerate(held)],
                               [v_cache[b, :n] for b, n in enumerate(held)],
                               causal=True, window=(2, -1))
    assert_close(out, want, "float32")
    # None: every element holds the whole cache; an int holds as many everywhere
    full = flash_attn_with_kvcache(a(q), a(k_cache), a(v_cache), softcap=1.5)
    want, _ = kvcache_expected(q, k_cache, v_cache, softcap=1.5)
    assert_close(full, want, "float32")
    one = flash_attn_with_kvcache(a(q), a(k_cache), a(v_cache), cache_seqlens=2)
    want, _ = kvcache_expected(q, k_cache[:, :2], v_cache[:, :2])
    assert_close(one, want, "float32")


def test_paged_kvcache(backend):
    rng = np.random.default_rng(10)
    page, batch = 4, 3
    held = np.array([6, 0, 11], np.int32)
    lnew = 2 if writeable(backend) else 0
    pool_k = rng.standard_normal((16, page, HKV, D)).astype(np.float32)
    pool_v = rng.standard_normal((16, page, HKV, D)).astype(np.float32)
    table = rng.permutation(16)[:batch * 4].reshape(batch, 4).astype(np.int32)
    q = rng.standard_normal((batch, 3, HQ, D)).astype(np.float32)
    k = rng.standard_normal((batch, lnew, HKV, D)).astype(np.float32)
    v = rng.standard_normal((batch, lnew, HKV, D)).astype(np.float32)
    slopes = np.array([0.3, 0.2, 0.1, 0.05], np.float32)
    a = backend.asarray
    kp, vp = a(pool_k), a(pool_v)
    out, lse = flash_attn_with_kvcache(
        a(q), kp, vp, a(k) if lnew else None, a(v) if lnew else None,
        cache_seqlens=a(held), block_table=a(table), causal=True, alibi_slopes=a(slopes),
        return_softmax_lse=True)
    keys = [pool_k[table[b]].reshape(-1, HKV, D) for b in range(batch)]
    values = [pool_v[table[b]].reshape(-1, HKV, D) for b in range(batch)]
    for b in range(batch):
        keys[b][held[b]:held[b] + lnew] = k[b]
        values[b][held[b]:held[b] + lnew] = v[b]
        np.testing.assert_array_equal(
            to_numpy(kp)[table[b]].reshape(-1, HKV, D)[:held[b] + lnew],
            keys[b][:held[b] + lnew])
    want_out, want_lse = kvcache_expected(
        q, [keys[b][:held[b] + lnew] for b in range(batch)],
        [values[b][:held[b] + lnew] for b in range(batch)], causal=True, slopes=slopes)
    assert_close(out, want_out, "float32")
    assert_close(lse, want_lse, "float32", "lse")


def test_immutable_cache_is_refused(backend):
    if writeable(backend):
        pytest.skip(f"{backend.name} arrays are mutable")
    q, k_cache, v_cache, k, v = cache_case()
    a = backend.asarray
    with pytest.raises(ValueError, match=r"k_cache cannot be written in place .*"
                                         r"portattn.PagedKVCache or portattn.KVCache"):
        flash_attn_with_kvcache(a(q), a(k_cache), a(v_cache), a(k), a(v), cache_seqlens=1)


def test_a_write_that_does_not_reach_the_cache_is_an_error(monkeypatch):
    import array_api_extra

    real = array_api_extra.at

    class Copying:  # what a library that copies on every update would do
        def __init__(self, x, idx=None):
            self.x, self.idx = x, idx

        def __getitem__(self, idx):
            return Copying(self.x, idx)

        def set(self, y, copy=None):
            return real(self.x)[self.idx].set(y, copy=True)

    monkeypatch.setattr(array_api_extra, "at", Copying)
    q, k_cache, v_cache, k, v = cache_case()
    with pytest.raises(ValueError, match="k_cache was not updated in place"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=1)


def test_read_only_numpy_cache_is_refused():
    q, k_cache, v_cache, k, v = cache_case()
    k_cache.flags.writeable = False
    before = v_cache.copy()
    with pytest.raises(ValueError, match="k_cache cannot be written in place"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=1)
    np.testing.assert_array_equal(v_cache, before)   # nothing written


VARLEN = packed([2, 3], [4, 5])


def varlen(**changes):
    q, k, v, cu_q, cu_k = VARLEN
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "max_seqlen_q": 3, "max_seqlen_k": 5}
    args.update(changes)
    return flash_attn_varlen_func(**args)


@pytest.mark.parametrize(("changes", "error", "text"), [
    ({"dropout_p": 0.1}, ValueError, "dropout_p=0.1 is not supported here"),
    ({"max_seqlen_q": 2}, ValueError,
     "max_seqlen_q must be at least the most queries of a sequence (3); got max_seqlen_q=2"),
    ({"max_seqlen_k": 4}, ValueError,
     "max_seqlen_k must be at least the most keys of a sequence (5); got max_seqlen_k=4"),
    ({"window_size": (-2, 0)}, ValueError, "got window_size=(-2, 0)"),
    ({"window_size": 3}, ValueError, "window_size must be a pair of ints >= -1"),
    ({"softcap": -1.0}, ValueError, "softcap must be a number >= 0 (0.0: none); got softcap=-1.0"),
    ({"cu_seqlens_q": np.array([0, 2, 4], np.int32)}, ValueError,
     "cu_seqlens_q must run from 0 to q.shape[0]=5; got cu_seqlens_q=[0, 2, 4]"),
    ({"cu_seqlens_q": np.array([0.0, 2.0, 5.0])}, ValueError,
     "cu_seqlens_q must be an integer array with 1 dims"),
    ({"cu_seqlens_k": np.array([0, 9], np.int32)}, ValueError,
     "cu_seqlens_k must have shape (3,); got cu_seqlens_k.shape=(2,)"),
    ({"cu_seqlens_k": np.array([0, 5, 4], np.int32)}, ValueError,
     "cu_seqlens_k must be non-decreasing from >= 0; got cu_seqlens_k=[0, 5, 4]"),
    ({"cu_seqlens_k": np.array([0, 4, 10], np.int32), "max_seqlen_k": 6}, ValueError,
     "cu_seqlens_k must end at most at k.shape[0]=9; got cu_seqlens_k[-1]=10"),
    ({"seqused_k": np.array([4, 6], np.int32)}, ValueError,
     "seqused_k[1] must lie in [0, cu_seqlens_k[2] - cu_seqlens_k[1]=5]; got seqused_k[1]=6"),
    ({"k": VARLEN[1][:, :1].repeat(3, axis=1), "v": VARLEN[2][:, :1].repeat(3, axis=1)},
     ValueError, "got q heads=4, D=8 and k heads=3, D=8"),
    ({"v": VARLEN[2].astype(np.float64)}, TypeError, "v.dtype=float64 differs from q.dtype"),
    ({"alibi_slopes": np.ones(3, np.float32)}, ValueError,
     "alibi_slopes must have shape (Hq,)=(4,) or (batch, Hq)=(2, 4); got "
     "alibi_slopes.shape=(3,)"),
    ({"block_table": np.zeros((2, 1), np.int32)}, ValueError,
     "k, v (num_blocks, page_block_size, Hkv, D)"),
])
def test_varlen_errors_name_the_argument(changes, error, text):
    with pytest.raises(error, match=re.escape(text)):
        varlen(**changes)


def test_paged_varlen_errors():
    _, k, v, _, cu_k = VARLEN
    kp, vp, table = paged_pools(k, v, cu_k, 4)
    with pytest.raises(ValueError, match=re.escape(
            "block_table must be (B, W) with B=len(cu_seqlens_q) - 1=2; got "
            "block_table.shape=(3, 2)")):
        varlen(k=kp, v=vp, block_table=np.zeros((3, 2), np.int32))
    with pytest.raises(ValueError, match=re.escape(
            "cu_seqlens_k[2] - cu_seqlens_k[1]=5 keys do not fit the 1 pages of 4")):
        varlen(k=kp, v=vp, block_table=table[:, :1])
    bad = table.copy()
    bad[1, 1] = 99
    with pytest.raises(ValueError, match=re.escape(
            "block_table[1] names pages outside the pool of 6 within the element's 5 "
            "keys; got pages [99]")):
        varlen(k=kp, v=vp, block_table=bad)


def kvcache(**changes):
    q, k_cache, v_cache, k, v = cache_case(seed=11)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v,
            "cache_seqlens": np.array([1, 2, 3], np.int32)}
    args.update(changes)
    return flash_attn_with_kvcache(**args)


@pytest.mark.parametrize(("changes", "text"), [
    ({"rotary_cos": np.ones((12, 4))}, "rotary_cos must be None: rotary embeddings"),
    ({"rotary_sin": np.ones((12, 4))}, "rotary_sin must be None"),
    ({"cache_leftpad": np.zeros(3, np.int32)}, "cache_leftpad must be None"),
    ({"v": None}, "k and v must be given together; got k of type ndarray, v of type NoneType"),
    ({"cache_seqlens": np.array([1, 11, 3], np.int32)},
     "cache_seqlens[1]=11 must lie in [0, 10]"),
    ({"cache_seqlens": -1}, "cache_seqlens must be an int >= 0; got cache_seqlens=-1"),
    ({"cache_seqlens": None}, "cache_seqlens must be given with k and v"),
    ({"cache_seqlens": np.array([1, 2], np.int32)},
     "cache_seqlens must have shape (3,); got cache_seqlens.shape=(2,)"),
    ({"cache_batch_idx": np.array([0, 4, 1], np.int32)},
     "cache_batch_idx must name rows of k_cache in [0, 4); got cache_batch_idx=[0, 4, 1]"),
    ({"cache_batch_idx": np.array([0, 2, 0], np.int32),
      "cache_seqlens": np.array([1, 2, 1], np.int32)},
     "k and v would write one cache slot twice (page 0, offset 1)"),
    ({"k": np.zeros((3, 2, HKV, 5), np.float32)}, "k and v must be (B, Lnew, Hkv, D)"),
    ({"num_splits": -1}, "num_splits must be an int >= 0; got num_splits=-1"),
    ({"window_size": (1, 2, 3)}, "window_size must be a pair of ints >= -1"),
    ({"block_table": np.zeros((3, 2), np.int32),
      "cache_batch_idx": np.array([0, 1, 2], np.int32)},
     "cache_batch_idx must be None with block_table"),
    ({"block_table": np.zeros((2, 2), np.int32)},
     "block_table must be (B, W) with B=q.shape[0]=3; got block_table.shape=(2, 2)"),
    ({"block_table": np.array([[0], [1], [5]], np.int32)},
     "block_table[2] names pages outside the pool of 4 within the element's 5 keys"),
])
def test_kvcache_errors_name_the_argument(changes, text):
    with pytest.raises(ValueError, match=re.escape(text)):
        kvcache(**changes)


def test_a_refused_call_writes_nothing():
    q, k_cache, v_cache, k, v = cache_case(seed=12)
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=1,
                                alibi_slopes=np.ones(3, np.float32))
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])
