"""Decode steps on paged keys and values, compiled with Numba (``pip install
portattn-numpy[jit]``); importing this module without Numba raises ``ImportError``.

A decode step has a few queries per sequence (one, or a short speculative run) against
that sequence's keys, which sit in pages of a shared pool in the order its block table
gives. Gathering them into a contiguous copy first costs as much memory traffic as the
attention itself; this loop reads each key and value row where it lies.

One work item is one sequence, run beside the others on the package's threads
(:func:`~portattn_numpy.set_num_threads`); with head-major pages, one sequence and one
key/value head (there each head's rows lie together; with token-major pages a key's
heads lie together, and one item reads them in one pass). An item holds its
sequence's query rows of every query head that reads its key/value heads
(grouped-query attention), and visits the keys the mask's band allows in chunks
of ``_CHUNK`` positions, aligned to the sequence's own positions: each key row and
value row is loaded once for all those query rows. Across chunks an online softmax
keeps each row's running maximum, denominator and weighted sum, all in float64
whatever the input's dtype, and so does each score's product. Every size and order is
the sequence's own, never the batch's: a sequence's output bits do not depend on the
other sequences of the call.

Non-finite inputs keep the package's rule: a row whose allowed keys include one with a
NaN or inf entry (a score that is not finite) or whose values make its sum not finite
is NaN, with a NaN log-sum-exp; keys a row may not see, and page slots past a
sequence's length, are never read into it.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from ._threads import get_num_threads, run_parallel

__all__ = ["paged_decode"]

#: Key positions per step of the online softmax (several pages, or part of one).
_CHUNK = 64
#: The band's open ends, as offsets no sequence reaches.
_BELOW, _ABOVE = -(2**62), 2**62
#: Reassociation lets the products over the head dimension run in SIMD lanes; no flag
#: assumes finite values, so the checks for NaN and inf stay.
_FASTMATH = {"contract", "reassoc"}


@numba.njit(nogil=True, boundscheck=False, cache=True, fastmath=_FASTMATH)
def _decode(query: Any, key_pages: Any, value_pages: Any, head_major: bool, table: Any,
            starts: Any, lengths: Any, lower: int, upper: int, scale: float,
            softcap: float, slopes: Any, sinks: Any, spread: int, first_item: int,
            stop_item: int, out: Any, lse: Any) -> None:  # pragma: no cover - compiled
    heads, depth = query.shape[1], query.shape[2]
    if head_major:
        page, kv_heads = key_pages.shape[2], key_pages.shape[1]
    else:
        page, kv_heads = key_pages.shape[1], key_pages.shape[2]
    value_depth = value_pages.shape[3]
    group = heads // kv_heads
    capped, biased, sunk = softcap > 0.0, slopes.shape[0] > 0, sinks.shape[0] > 0
    parts = kv_heads // spread
    for item in range(first_item, stop_item):
        s, kv0 = item // parts, (item % parts) * spread
        first, count, length = starts[s], starts[s + 1] - starts[s], lengths[s]
        if count == 0:
            continue
        rows = spread * count * group
        # Row ((c * count) + i) * group + g: query i of s, head (kv0 + c) * group + g.
        q = np.empty((rows, depth))
        for c in range(spread):
            for i in range(count):
                for g in range(group):
                    for d in range(depth):
                        q[(c * count + i) * group + g, d] = (
                            query[first + i, (kv0 + c) * group + g, d] * scale)
        # Keys row i may see: positions lo[i] to hi[i], its band within 0 .. length-1.
        lo = np.empty(count, np.int64)
        hi = np.empty(count, np.int64)
        for i in range(count):
            p = length - count + i
            lo[i] = max(0, p + lower) if lower > _BELOW else 0
            hi[i] = min(length - 1, p + upper) if upper < _ABOVE else length - 1
        top = np.full(rows, -np.inf)
        total = np.zeros(rows)
        acc = np.zeros((rows, value_depth))
        bad = np.zeros(rows, np.bool_)
        scores = np.empty((rows, _CHUNK))
        begin, end = lo[0], hi[count - 1]  # bands move right with the position
        for j0 in range((begin // _CHUNK) * _CHUNK, end + 1, _CHUNK):
            c0, c1 = max(j0, begin), min(j0 + _CHUNK, end + 1)
            for j in range(c0, c1):
                slot, at = table[s, j // page], j % page
                for c in range(spread):
                    kv = kv0 + c
                    k = key_pages[slot, kv, at] if head_major else key_pages[slot, at, kv]
                    for i in range(count):
                        if j < lo[i] or j > hi[i]:
                            continue
                        for g in range(group):
                            r = (c * count + i) * group + g
                            x = 0.0
                            for d in range(depth):
                                x += q[r, d] * k[d]
                            if not math.isfinite(x):
                                bad[r] = True
                            if capped:
                                x = softcap * math.tanh(x / softcap)
                            if biased:
                                x -= slopes[s, kv * group + g] * abs(length - count + i - j)
                            scores[r, j - j0] = x
            for r in range(rows):
                i = (r // group) % count
                a, b = max(c0, lo[i]), min(c1 - 1, hi[i])
                if bad[r] or a > b:
                    continue
                new = top[r]
                for j in range(a, b + 1):
                    new = max(new, scores[r, j - j0])
                if new > top[r]:
                    alpha = math.exp(top[r] - new)
                    total[r] *= alpha
                    for d in range(value_depth):
                        acc[r, d] *= alpha
                    top[r] = new
                for j in range(a, b + 1):
                    w = math.exp(scores[r, j - j0] - new)
                    scores[r, j - j0] = w
                    total[r] += w
            for j in range(c0, c1):
                slot, at = table[s, j // page], j % page
                for c in range(spread):
                    kv = kv0 + c
                    v = value_pages[slot, kv, at] if head_major else value_pages[slot, at, kv]
                    for i in range(count):
                        if j < lo[i] or j > hi[i]:
                            continue
                        for g in range(group):
                            r = (c * count + i) * group + g
                            if bad[r]:
                                continue
                            w = scores[r, j - j0]
                            for d in range(value_depth):
                                acc[r, d] += w * v[d]
        for r in range(rows):
            c, i, g = r // (count * group), (r // group) % count, r % group
            h = (kv0 + c) * group + g
            m, z = top[r], total[r]
            if sunk:  # the sink joins the denominator, no value
                sink = sinks[s, h]
                peak = max(m, sink)
                if peak > -np.inf:
                    z = z * math.exp(m - peak) + math.exp(sink - peak)
                    for d in range(value_depth):
                        acc[r, d] *= math.exp(m - peak)
                    m = peak
            finite = not bad[r]
            for d in range(value_depth):
                if not math.isfinite(acc[r, d]):
                    finite = False
            if not finite:
                for d in range(value_depth):
                    out[first + i, h, d] = np.nan
                lse[h, first + i] = np.nan
            elif z > 0.0:
                for d in range(value_depth):
                    out[first + i, h, d] = acc[r, d] / z
                lse[h, first + i] = m + math.log(z)


def paged_decode(query: Any, key_pages: Any, value_pages: Any, head_major: bool,
                 block_table: Any, query_starts: Any, key_lengths: Any, lower: int | None,
                 upper: int | None, scale: float, softcap: float | None,
                 alibi_slopes: Any, sinks: Any) -> tuple[np.ndarray, np.ndarray]:
    """Attention of each sequence's few queries to its paged keys and values.

    Args:
        query: ``(T, Hq, D)``, float32 or float64; sequence ``s`` owns rows
            ``query_starts[s]:query_starts[s + 1]``, its last positions: with ``n``
            queries, query ``i`` sits at ``key_lengths[s] - n + i``.
        key_pages: ``(P, page, Hkv, D)``, or ``(P, Hkv, page, D)`` with ``head_major``;
            the dtype of ``query``. Key ``j`` of ``s`` is row ``j % page`` of page
            ``block_table[s, j // page]``.
        value_pages: the same with ``Dv``.
        head_major: the pools' layout, as above.
        block_table: int32 ``(S, W)``; entries past a sequence's length are not read.
        query_starts: int64 ``(S + 1,)``.
        key_lengths: int64 ``(S,)``.
        lower, upper: the mask as a band: key ``j`` is seen from position ``p`` where
            ``j - p >= lower`` and ``j - p <= upper``; None leaves that side open (to
            the sequence's keys ``0 .. key_lengths[s] - 1``).
        scale: multiplies ``q @ k``.
        softcap: scores become ``softcap * tanh(s / softcap)``; None for none.
        alibi_slopes: None or ``(S, Hq)``: ``-slope * |p - j|`` joins the score.
        sinks: None or ``(S, Hq)``: each row's denominator gains ``exp(sink)``.

    Returns:
        ``(out, lse)``: ``(T, Hq, Dv)`` and ``(Hq, T)``, both in the dtype of
        ``query``. A row that sees no key gives 0 and an lse of ``-inf`` (its sink
        with ``sinks``); one that sees a non-finite key or value gives NaN.
    """
    dtype = query.dtype
    query = np.ascontiguousarray(query)
    key_pages = np.ascontiguousarray(key_pages, dtype)
    value_pages = np.ascontiguousarray(value_pages, dtype)
    count, heads = query.shape[0], query.shape[1]
    out = np.zeros((count, heads, value_pages.shape[3]), dtype)
    lse = np.full((heads, count), -np.inf, dtype)
    none = np.empty((0, 0))
    spread = 1 if head_major else key_pages.shape[2]
    kv_heads = key_pages.shape[1 if head_major else 2]
    arguments = (
        query, key_pages, value_pages, bool(head_major),
        np.ascontiguousarray(block_table, np.int32),
        np.ascontiguousarray(query_starts, np.int64),
        np.ascontiguousarray(key_lengths, np.int64),
        _BELOW if lower is None else int(lower), _ABOVE if upper is None else int(upper),
        float(scale), 0.0 if softcap is None else float(softcap),
        none if alibi_slopes is None else np.ascontiguousarray(alibi_slopes, np.float64),
        none if sinks is None else np.ascontiguousarray(sinks, np.float64), spread)

    def worker(items: Any) -> None:
        for item in items:  # each item writes rows of its own: no two touch one
            _decode(*arguments, item, item + 1, out, lse)

    items = len(key_lengths) * (kv_heads // spread)
    run_parallel(worker, list(range(items)), get_num_threads())
    return out, lse
