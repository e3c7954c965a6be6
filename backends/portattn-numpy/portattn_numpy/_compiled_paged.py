"""Paged attention compiled with Numba (``pip install portattn-numpy[jit]``); importing
this module without Numba raises ``ImportError``.

Each sequence's queries attend its own keys, which sit in pages of a shared pool in the
order its block table gives. One work item is one tile of at most
:data:`TILE_QUERIES` of a sequence's queries with its key/value heads (all of them
with token-major pages, which hold a key's heads side by side; one with head-major
pages), each with every query head that reads it (grouped-query attention); items run
beside each other on the package's threads (:func:`~portattn_numpy.set_num_threads`).

An item visits the keys its rows' bands allow, ``_CHUNK`` positions at a time, aligned
to the sequence's own positions. The chunk's key rows, then its value rows, are copied
from their pages into a scratch of ``_CHUNK`` rows that stays in cache (as BLAS packs
its operands; nothing of the size of the sequence is made), and NumPy's own BLAS
(``_cblas``) forms the chunk's scores and adds its weights times values to the item's
accumulator; a head with one query row there (a decode step without grouped heads)
takes loops of this module instead, which read its rows where they are. In between,
each row's scores become their weights, base 2, in one vectorised pass
(``_compiled_exp``), with the online softmax's running maximum and sum. A score change
(softcap, ALiBi) is one more pass over the chunk's scores.

An item whose sums or outputs come out not finite is done again by a careful scalar
loop (float64 throughout), which keeps the package's rule: a row whose allowed keys
include one with a NaN or inf entry, or whose values make its sum not finite, is NaN,
with a NaN log-sum-exp; keys a row may not see, and page slots past a sequence's
length, are never read into it. Scores past the largest value of the inputs' dtype are
the infinities they are in every other kernel (``+inf`` makes the row NaN, ``-inf``
gives the key weight 0), not the float64 values the careful loop could keep.

Every size and order is the sequence's own, never the batch's: a sequence's output
bits do not depend on the other sequences of the call.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from . import _cblas
from ._compiled_blas import NO_TRANS, TRANS, gemm, pointer
from ._compiled_exp import DTYPES, LOOP_OPTIONS, constants, power
from ._threads import run_parallel

__all__ = ["TILE_QUERIES", "paged_forward"]

#: The most queries of one sequence one work item takes; longer runs are cut in tiles.
TILE_QUERIES = 64
#: Key positions per step of the online softmax (several pages, or part of one).
_CHUNK = 256
#: The band's open ends, as offsets no sequence reaches.
_BELOW, _ABOVE = -(2**62), 2**62
_LOG2E = 1 / math.log(2)
#: ``exp2``'s constants by dtype (made once: they take a decimal logarithm).
_EXP2 = {dt: constants(dt, base_e=False) for dt in DTYPES}


@numba.njit(**{**LOOP_OPTIONS, "fastmath": {"contract", "reassoc"}})
def _exp2_sum(row: Any, top: Any, c: Any) -> Any:  # pragma: no cover - compiled
    """``2**(x - top)`` in place of each entry of ``row``, and their sum. Compiled
    apart, with reassociation, so that the sum stays in the vector lanes."""
    total = c.zero
    for j in range(row.shape[0]):
        y = power(row[j] - top, c)
        row[j] = y
        total += y
    return total


@numba.njit(**LOOP_OPTIONS)
def _row_max(row: Any, start: Any) -> Any:  # pragma: no cover - compiled
    """The largest of ``start`` and the entries of ``row``, four lanes at a time (a
    NaN among them shows later, in the sums)."""
    m0 = m1 = m2 = m3 = start
    fours = row.shape[0] - row.shape[0] % 4
    for j in range(0, fours, 4):
        m0, m1 = max(m0, row[j]), max(m1, row[j + 1])
        m2, m3 = max(m2, row[j + 2]), max(m3, row[j + 3])
    for j in range(fours, row.shape[0]):
        m0 = max(m0, row[j])
    return max(max(m0, m1), max(m2, m3))


@numba.njit(**LOOP_OPTIONS)
def _bands(length: int, count: int, q0: int, q1: int, lower: int,
           upper: int) -> tuple[Any, Any]:  # pragma: no cover - compiled
    """The first and last key each query ``q0 .. q1 - 1`` of a sequence may see (its
    band within ``0 .. length - 1``); a query at position ``p = length - count + i``."""
    lo = np.empty(q1 - q0, np.int64)
    hi = np.empty(q1 - q0, np.int64)
    for i in range(q0, q1):
        p = length - count + i
        lo[i - q0] = max(0, p + lower) if lower > _BELOW else 0
        hi[i - q0] = min(length - 1, p + upper) if upper < _ABOVE else length - 1
    return lo, hi


@numba.njit(**LOOP_OPTIONS)
def _rows(pages: Any, head_major: bool, table: Any, s: int, kv0: int, spread: int, c0: int,
          c1: int, scratch: Any) -> tuple[int, int, int]:  # pragma: no cover - compiled
    """Where BLAS reads rows ``c0 .. c1 - 1`` of sequence ``s``'s heads ``kv0 ..
    kv0 + spread - 1``: the address of head ``kv0``'s first row, the leading dimension
    and the bytes from one head's rows to the next's. In place where the rows lie
    evenly spaced in one page (a page of a chunk or more, or a contiguous cache seen as
    one page), else copied from their pages into ``scratch`` (``(chunk, spread,
    D)``: a key's heads side by side, as a token-major page holds them)."""
    page = pages.shape[2] if head_major else pages.shape[1]
    size, depth = pages.itemsize, pages.shape[3]
    step = pages.strides[2] if head_major else pages.strides[1]
    head = pages.strides[1] if head_major else pages.strides[2]
    if ((c1 - 1) // page == c0 // page and pages.strides[3] == size and step % size == 0
            and step >= size * depth):
        slot, at = table[s, c0 // page], c0 % page
        return (pages.ctypes.data + slot * pages.strides[0] + kv0 * head + at * step,
                step // size, head)
    for j in range(c0, c1):
        slot, at = table[s, j // page], j % page
        for c in range(spread):
            row = pages[slot, kv0 + c, at] if head_major else pages[slot, at, kv0 + c]
            copy = scratch[j - c0, c]
            for d in range(depth):
                copy[d] = row[d]
    return scratch.ctypes.data, spread * depth, depth * size


@numba.njit(**{**LOOP_OPTIONS, "fastmath": {"contract", "reassoc"}})
def _dots(address: int, lead: int, x: Any, out: Any,
          zero: Any) -> None:  # pragma: no cover - compiled
    """``out[j] = row_j . x`` for the rows at ``address``, ``lead`` entries apart: the
    scores of a head with one query row (a decode step without grouped heads), the sum
    over the head dimension in SIMD lanes (about twice as fast as BLAS's ``gemv`` on a
    chunk of a 64-wide head)."""
    rows = numba.carray(pointer(address, x[0]), (out.shape[0], lead))
    for j in range(out.shape[0]):
        row = rows[j]
        total = zero
        for d in range(x.shape[0]):
            total += row[d] * x[d]
        out[j] = total


@numba.njit(**LOOP_OPTIONS)
def _add_weighted(address: int, lead: int, weights: Any,
                  acc: Any) -> None:  # pragma: no cover - compiled
    """``acc += weights @ rows``, the rows as :func:`_dots` reads them: that head's
    weights times its values."""
    rows = numba.carray(pointer(address, acc[0]), (weights.shape[0], lead))
    for j in range(weights.shape[0]):
        row, w = rows[j], weights[j]
        for d in range(acc.shape[0]):
            acc[d] += w * row[d]


@numba.njit(**LOOP_OPTIONS)
def _fast(address: int, query: Any, key_pages: Any, value_pages: Any,
          head_major: bool, table: Any, item: Any, spread: int, starts: Any, lengths: Any,
          lower: int, upper: int, scale: float, softcap: float, slopes: Any, sinks: Any, c: Any,
          one: Any, out: Any, lse: Any) -> bool:  # pragma: no cover - compiled
    """One item by BLAS (the module's docstring); False, writing nothing, where a sum
    or an output is not finite. ``address`` is ``?gemm``'s; a head with one query row
    in a chunk takes compiled loops instead (:func:`_dots`, :func:`_add_weighted`)."""
    depth, value_depth = query.shape[2], value_pages.shape[3]
    kv_heads = key_pages.shape[1] if head_major else key_pages.shape[2]
    group = query.shape[1] // kv_heads
    s, kv0, q0, q1 = item[0], item[1], item[2], item[3]
    first, count, length = starts[s], starts[s + 1] - starts[s], lengths[s]
    rows = (q1 - q0) * group  # per key/value head
    changed = softcap > 0.0 or slopes.shape[0] > 0
    zero = one - one
    size = query.itemsize
    # Row c * rows + (i - q0) * group + g: query i of s, head (kv0 + c) * group + g.
    # Scores come out in base 2, or in their own units where a change comes first.
    factor = scale if changed else scale * _LOG2E
    q = np.empty((spread * rows, depth), query.dtype)
    for r in range(spread * rows):
        head = (kv0 + r // rows) * group + r % group
        source, scaled = query[first + q0 + (r % rows) // group, head], q[r]
        for d in range(depth):
            scaled[d] = source[d] * factor
    lo, hi = _bands(length, count, q0, q1, lower, upper)
    top = np.full(spread * rows, -np.inf, query.dtype)
    total = np.zeros(spread * rows, query.dtype)
    acc = np.zeros((spread * rows, value_depth), query.dtype)
    chunk = _CHUNK
    span = np.empty((spread * rows, chunk), query.dtype)
    keys = np.empty((chunk, spread, depth), query.dtype)
    values = np.empty((chunk, spread, value_depth), query.dtype)
    begin, end, last = lo[0], hi[q1 - q0 - 1], q1 - q0 - 1  # bands move right
    for j0 in range((begin // chunk) * chunk, end + 1, chunk):
        c0, c1 = max(j0, begin), min(j0 + chunk, end + 1)
        n = c1 - c0
        i0, i1 = 0, last + 1  # the queries that see a key of this chunk
        while hi[i0] < c0:
            i0 += 1
        while lo[i1 - 1] >= c1:
            i1 -= 1
        at, lead, apart = _rows(key_pages, head_major, table, s, kv0, spread, c0, c1, keys)
        for h in range(spread):
            r0, r1 = h * rows + i0 * group, h * rows + i1 * group
            if r1 - r0 == 1:
                _dots(at + h * apart, lead, q[r0], span[r0, :n], zero)
            else:
                gemm(address, NO_TRANS, TRANS, r1 - r0, n, depth, one,
                     q.ctypes.data + r0 * depth * size, depth, at + h * apart, lead, zero,
                     span.ctypes.data + r0 * chunk * size, chunk)
            for r in range(r0, r1):
                i = (r - h * rows) // group
                row = span[r, :n]
                a, b = max(lo[i] - c0, 0), min(hi[i] - c0 + 1, n)
                if changed:
                    slope = slopes[s, (kv0 + h) * group + r % group] if slopes.shape[0] else 0.0
                    p = length - count + q0 + i - c0  # the position, from the chunk's first
                    for j in range(a, b):
                        x = row[j]
                        if softcap > 0.0:
                            x = softcap * math.tanh(x / softcap)
                        row[j] = (x - slope * abs(p - j)) * _LOG2E
                for j in range(a):
                    row[j] = -np.inf
                for j in range(b, n):
                    row[j] = -np.inf
                m = _row_max(row[a:b], top[r])
                if m == -np.inf:
                    if b > a:  # every score it sees is -inf or NaN: the careful loop's
                        return False
                    row[:] = 0  # nothing seen yet: weights 0
                    continue
                if m > top[r]:
                    alpha = power(top[r] - m, c)
                    total[r] *= alpha
                    acc[r] *= alpha
                    top[r] = m
                total[r] += _exp2_sum(row, m, c)
        at, lead, apart = _rows(value_pages, head_major, table, s, kv0, spread, c0, c1,
                                values)
        for h in range(spread):
            r0, r1 = h * rows + i0 * group, h * rows + i1 * group
            if r1 - r0 == 1:
                _add_weighted(at + h * apart, lead, span[r0, :n], acc[r0])
            else:
                gemm(address, NO_TRANS, NO_TRANS, r1 - r0, value_depth, n, one,
                     span.ctypes.data + r0 * chunk * size, chunk, at + h * apart, lead,
                     one, acc.ctypes.data + r0 * value_depth * size, value_depth)
    for r in range(spread * rows):
        if not (total[r] - total[r] == 0 and (top[r] - top[r] == 0 or top[r] == -np.inf)):
            return False
        for d in range(value_depth):
            if acc[r, d] - acc[r, d] != 0:  # NaN or inf give NaN
                return False
    for r in range(spread * rows):
        i, h = first + q0 + (r % rows) // group, (kv0 + r // rows) * group + r % group
        m = top[r] / _LOG2E + math.log(total[r]) if total[r] > 0 else -np.inf
        z = 1.0 / total[r] if total[r] > 0 else 0.0
        if sinks.shape[0]:  # the sink joins the denominator, no value
            joined = np.logaddexp(m, sinks[s, h])
            z *= math.exp(m - joined) if m > -np.inf else 0.0
            m = joined
        for d in range(value_depth):
            out[i, h, d] = acc[r, d] * z
        lse[h, i] = m
    return True


@numba.njit(**{**LOOP_OPTIONS, "fastmath": {"contract", "reassoc"}})
def _careful(query: Any, key_pages: Any, value_pages: Any, head_major: bool, table: Any,
             item: Any, starts: Any, lengths: Any, lower: int, upper: int, scale: float,
             softcap: float, slopes: Any, sinks: Any, out: Any, lse: Any,
             largest: float) -> None:  # pragma: no cover - compiled
    """One item by a scalar loop in float64 that tells which rows see a non-finite
    value (the module's docstring). Reassociation lets the products over the head
    dimension run in SIMD lanes; no flag assumes finite values. A score past
    ``largest`` (the inputs' dtype's) is what the fast loop and the other kernels make
    of it in that dtype, an infinity: ``+inf`` makes its row NaN, ``-inf`` a weight of
    0 (before a softcap, which bounds either)."""
    depth, value_depth = query.shape[2], value_pages.shape[3]
    page = key_pages.shape[2] if head_major else key_pages.shape[1]
    kv_heads = key_pages.shape[1] if head_major else key_pages.shape[2]
    group = query.shape[1] // kv_heads
    capped, biased, sunk = softcap > 0.0, slopes.shape[0] > 0, sinks.shape[0] > 0
    s, kv, q0, q1 = item[0], item[1], item[2], item[3]
    first, count, length = starts[s], starts[s + 1] - starts[s], lengths[s]
    rows = (q1 - q0) * group
    q = np.empty((rows, depth))
    for r in range(rows):
        for d in range(depth):
            q[r, d] = query[first + q0 + r // group, kv * group + r % group, d] * scale
    lo, hi = _bands(length, count, q0, q1, lower, upper)
    top = np.full(rows, -np.inf)
    total = np.zeros(rows)
    acc = np.zeros((rows, value_depth))
    bad = np.zeros(rows, np.bool_)
    scores = np.empty((rows, _CHUNK))
    begin, end = lo[0], hi[q1 - q0 - 1]
    for j0 in range((begin // _CHUNK) * _CHUNK, end + 1, _CHUNK):
        c0, c1 = max(j0, begin), min(j0 + _CHUNK, end + 1)
        for j in range(c0, c1):
            slot, at = table[s, j // page], j % page
            k = key_pages[slot, kv, at] if head_major else key_pages[slot, at, kv]
            for r in range(rows):
                i = r // group
                if j < lo[i] or j > hi[i]:
                    continue
                x = 0.0
                for d in range(depth):
                    x += q[r, d] * k[d]
                if not math.isfinite(x):
                    bad[r] = True
                elif abs(x) > largest:  # overflows where the other kernels compute
                    x = math.copysign(math.inf, x)
                    bad[r] = bad[r] or (x > 0 and not capped)
                if capped:
                    x = softcap * math.tanh(x / softcap)
                if biased:
                    x -= slopes[s, kv * group + r % group] * abs(length - count + q0 + i - j)
                scores[r, j - j0] = x
        for r in range(rows):
            i = r // group
            a, b = max(c0, lo[i]), min(c1 - 1, hi[i])
            if bad[r] or a > b:
                continue
            new = top[r]
            for j in range(a, b + 1):
                new = max(new, scores[r, j - j0])
            if new == -np.inf:  # every score so far overflowed to -inf: weights 0
                for j in range(a, b + 1):
                    scores[r, j - j0] = 0.0
                continue
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
            v = value_pages[slot, kv, at] if head_major else value_pages[slot, at, kv]
            for r in range(rows):
                i = r // group
                if j < lo[i] or j > hi[i] or bad[r]:
                    continue
                w = scores[r, j - j0]
                for d in range(value_depth):
                    acc[r, d] += w * v[d]
    for r in range(rows):
        i, h = first + q0 + r // group, kv * group + r % group
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
                out[i, h, d] = np.nan
            lse[h, i] = np.nan
        elif z > 0.0:
            for d in range(value_depth):
                out[i, h, d] = acc[r, d] / z
            lse[h, i] = m + math.log(z)


def work_items(query_starts: Any, kv_heads: int, spread: int) -> np.ndarray:
    """``(sequence, first kv_head, q0, q1)`` rows of int64: each sequence's queries cut
    in tiles of :data:`TILE_QUERIES`, for each run of ``spread`` key/value heads (sizes
    fixed by the sequence alone)."""
    items = [(s, kv, q0, min(q0 + TILE_QUERIES, n))
             for s, n in enumerate(np.diff(np.asarray(query_starts)).tolist())
             for q0 in range(0, n, TILE_QUERIES) for kv in range(0, kv_heads, spread)]
    return np.array(items, np.int64).reshape(-1, 4)


def paged_forward(query: Any, key_pages: Any, value_pages: Any, head_major: bool,
                  block_table: Any, query_starts: Any, key_lengths: Any, lower: int | None,
                  upper: int | None, scale: float, softcap: float | None,
                  alibi_slopes: Any, sinks: Any, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """Attention of each sequence's queries to its paged keys and values.

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
        threads: how many threads share the work items.

    Returns:
        ``(out, lse)``: ``(T, Hq, Dv)`` and ``(Hq, T)``, both in the dtype of
        ``query``. A row that sees no key gives 0 and an lse of ``-inf`` (its sink
        with ``sinks``); one that sees a non-finite key or value gives NaN.
    """
    dtype = query.dtype
    query = np.ascontiguousarray(query)
    key_pages, value_pages = np.asarray(key_pages, dtype), np.asarray(value_pages, dtype)
    total, heads = query.shape[0], query.shape[1]
    out = np.zeros((total, heads, value_pages.shape[3]), dtype)
    lse = np.full((heads, total), -np.inf, dtype)
    none = np.empty((0, 0))
    kv_heads = key_pages.shape[1 if head_major else 2]
    # token-major pages hold a key's heads side by side: one item reads them together
    spread = 1 if head_major else kv_heads
    items = work_items(query_starts, kv_heads, spread)
    shared = (query, key_pages, value_pages, bool(head_major),
              np.ascontiguousarray(block_table, np.int32))
    rest = (np.ascontiguousarray(query_starts, np.int64),
            np.ascontiguousarray(key_lengths, np.int64),
            _BELOW if lower is None else int(lower), _ABOVE if upper is None else int(upper),
            float(scale), 0.0 if softcap is None else float(softcap),
            none if alibi_slopes is None else np.ascontiguousarray(alibi_slopes, np.float64),
            none if sinks is None else np.ascontiguousarray(sinks, np.float64))
    address = _cblas.gemm_address(dtype)
    c, one = _EXP2[dtype], dtype.type(1)
    largest = float(np.finfo(dtype).max)

    def worker(units: Any) -> None:
        for k in units:  # each item writes rows of its own: no two touch one
            item = items[k]
            if address is None or not _fast(address, *shared, item, spread,
                                            *rest, c, one, out, lse):
                for kv in range(item[1], item[1] + spread):  # one head at a time
                    _careful(*shared, np.array([item[0], kv, item[2], item[3]]), *rest,
                             out, lse, largest)

    run_parallel(worker, list(range(len(items))), threads)
    return out, lse
