"""Packed queries of many sequences against keys and values held in pages.

Each sequence's queries are cut into query tiles, and each tile reads its sequence's
keys a chunk of pages at a time, straight from the page pool through the block table,
with an online softmax over the chunks: memory holds one chunk per tile, never a
sequence gathered whole. Tiles of one size are computed together, all sequences at
once.

Every size is fixed by the sequence itself (its query tile by its own number of
queries, the chunks by the page size), never by the batch, and a tile's chunks run in
one order whoever shares the batch: a sequence's output does not depend on the other
sequences in its batch.
"""

from __future__ import annotations

import warnings
from typing import Any

from .._inputs import PagedInputs, QueryTiles
from .._lib import values_readable
from ._portable import (
    Scores,
    attend_values,
    cast,
    finish,
    finite_or_zero,
    lowest,
    with_empty_rows,
    with_rows,
)


def attend_pages(call: PagedInputs) -> tuple[Any, Any]:
    """``(out (T, Hq, Dv), lse (Hq, T))``; a query that sees no key gives 0 and an lse
    of ``-inf`` (its head's sink with sinks)."""
    xp = call.xp
    total, heads = call.query.shape[:2]
    if total == 0:
        out = xp.zeros((0, heads, call.value_pages.shape[-1]), dtype=call.query.dtype,
                       device=call.device_obj)
        return out, xp.zeros((heads, 0), dtype=call.compute_dtype, device=call.device_obj)
    outs, lses, order = [], [], []
    for tiles in call.query_tiles():
        out, lse = _tiles(call, tiles)
        outs.append(xp.reshape(out, (-1, *out.shape[2:])))
        lses.append(xp.reshape(lse, (-1, lse.shape[-1])))
        for t, start in enumerate(tiles.rows):
            for r in range(tiles.size):
                order.append(start + r if r < tiles.count[t] else -1)
    # Row i of the result is the tile row that computed packed query i.
    where = [0] * total
    for index, row in enumerate(order):
        if row >= 0:
            where[row] = index
    out = xp.concat(outs, axis=0) if len(outs) > 1 else outs[0]
    lse = xp.concat(lses, axis=0) if len(lses) > 1 else lses[0]
    pick = xp.asarray(where, dtype=xp.int32, device=call.device_obj)
    out = cast(xp, xp.take(out, pick, axis=0), call.query.dtype)
    return out, xp.permute_dims(xp.take(lse, pick, axis=0), (1, 0))


def _tiles(call: PagedInputs, tiles: QueryTiles) -> tuple[Any, Any]:
    """``(out (N, size, Hq, Dv), lse (N, size, Hq))`` of tiles of one size."""
    xp, dev, ct = call.xp, call.device_obj, call.compute_dtype
    size, n = tiles.size, len(tiles.sequence)
    hkv = call.num_kv_heads
    hq, dim = call.query.shape[1], call.query.shape[2]
    group = hq // hkv

    def device_ints(values: list[int]) -> Any:
        return xp.asarray(values, dtype=xp.int32, device=dev)

    # Queries (N, Hkv, G, size, D), the padding rows reading query 0 (never shown).
    rows = [tiles.rows[t] + r if r < tiles.count[t] else 0
            for t in range(n) for r in range(size)]
    q = xp.take(call.query, device_ints(rows), axis=0)
    q = xp.reshape(cast(xp, q, ct) * call.scale, (n, size, hkv, group, dim))
    q = xp.permute_dims(q, (0, 2, 3, 1, 4))
    sequence = device_ints(tiles.sequence)
    positions = (xp.reshape(device_ints(tiles.position), (n, 1))
                 + xp.reshape(xp.arange(size, dtype=xp.int32, device=dev), (1, size)))
    real = (xp.reshape(xp.arange(size, dtype=xp.int32, device=dev), (1, size))
            < xp.reshape(device_ints(tiles.count), (n, 1)))
    lengths = xp.take(call.key_counts, sequence, axis=0)
    table = xp.take(call.block_table, sequence, axis=0)
    slopes = None if call.alibi_slopes is None else _per_head(
        xp, xp.take(call.alibi_slopes, sequence, axis=0), hkv, ct)
    # Nothing seen yet: no mass, the lowest maximum (joining a chunk to it is exact).
    shape = (n, hkv, group, size)
    state = (xp.zeros((*shape, call.value_pages.shape[-1]), dtype=ct, device=dev),
             xp.full((*shape, 1), lowest(xp, ct), dtype=ct, device=dev),
             xp.zeros((*shape, 1), dtype=ct, device=dev))
    for chunk in range(max(tiles.stop, default=0)):
        active = [t for t in range(n) if tiles.first[t] <= chunk < tiles.stop[t]]
        if not active:
            continue
        pick = None if len(active) == n else device_ints(active)

        def part(x: Any, pick: Any = pick) -> Any:
            return x if pick is None else xp.take(x, pick, axis=0)

        keys, values, slot = _chunk(call, part(table), chunk, ct)
        s = per_head_matmul(xp, part(q), [xp.permute_dims(k, (0, 2, 1)) for k in keys])
        if call.softcap is not None:
            s = xp.tanh(s / call.softcap) * call.softcap
        rows_at = part(positions)[:, :, None]
        if slopes is not None:
            distance = cast(xp, xp.abs(rows_at - slot[None, None, :]), ct)
            s = s - part(slopes) * distance[:, None, None, :, :]
        allowed = (part(real)[:, :, None]
                   & (slot[None, None, :] < part(lengths)[:, None, None]))
        if call.mask is not None:
            allowed = allowed & call.mask.allows(xp, 0, 0, rows_at, slot[None, None, :],
                                                 0, 0)
        allowed = allowed[:, None, None, :, :]
        step = _step(xp, Scores(xp.where(allowed, s, lowest(xp, ct)), allowed), values)
        state = _merged(xp, state, step, pick, active)
    acc, m, denom = state
    sinks = None if call.sinks is None else _per_head(
        xp, xp.take(call.sinks, sequence, axis=0), hkv, ct)
    if sinks is not None:
        top = xp.maximum(m, sinks)
        alpha = xp.exp(m - top)
        acc, m, denom = acc * alpha, top, denom * alpha + xp.exp(sinks - top)
    out, lse, has_mass = finish(xp, acc, m, denom)
    lse = with_empty_rows(xp, lse, has_mass)
    out = xp.reshape(xp.permute_dims(out, (0, 3, 1, 2, 4)), (n, size, hq, -1))
    lse = xp.reshape(xp.permute_dims(lse, (0, 3, 1, 2)), (n, size, hq))
    return out, lse


def _per_head(xp: Any, values: Any, hkv: int, dtype: Any) -> Any:
    """``(N, Hq)`` per-tile head values as ``(N, Hkv, G, 1, 1)``."""
    n, hq = values.shape
    return xp.reshape(cast(xp, values, dtype), (n, hkv, hq // hkv, 1, 1))


def _chunk(call: PagedInputs, table: Any, chunk: int, dtype: Any) -> tuple[Any, Any, Any]:
    """Keys ``(N, tk, D)`` and values ``(N, tk, Dv)`` of one chunk for each tile (read
    through its block table rows ``table``), one of each per key/value head, and the
    chunk's key positions ``(tk,)``. A head's keys are a view of the gathered pages
    (rows ``Hkv * D`` apart with ``layout="blhd"``), which products read as they lie:
    no copy but the gather."""
    xp, page = call.xp, call.page_size
    per_chunk = call.chunk_keys // page
    width = table.shape[1]
    first = chunk * per_chunk
    pages = table[:, first:min(width, first + per_chunk)]
    short = per_chunk - pages.shape[1]
    if short > 0:  # past the table's width: page 0, hidden by the sequence's length
        pages = xp.concat([pages, xp.zeros((pages.shape[0], short), dtype=pages.dtype,
                                           device=call.device_obj)], axis=1)
    pages = xp.where(pages < 0, 0, pages)  # unused entries (-1): hidden likewise
    n, keys = pages.shape[0], per_chunk * page
    flat = xp.reshape(pages, (-1,))
    hkv = call.num_kv_heads

    def read(pool: Any) -> list[Any]:
        dim = pool.shape[-1]
        if call.head_major:  # (P, Hkv, page, D): each head's pages gathered apart
            heads = [xp.take(pool[:, h, ...], flat, axis=0) for h in range(hkv)]
        else:  # (P, page, Hkv, D): whole pages gathered once
            x = xp.take(pool, flat, axis=0)
            heads = [x[:, :, h, :] for h in range(hkv)]
        # in two steps, as Dask can: split the pages by tile, then join each tile's
        return [cast(xp, xp.reshape(xp.reshape(x, (n, per_chunk, page, dim)), (n, keys, dim)),
                     dtype) for x in heads]

    slot = xp.arange(chunk * keys, (chunk + 1) * keys, dtype=xp.int32, device=call.device_obj)
    return read(call.key_pages), read(call.value_pages), slot


def _step(xp: Any, tile: Scores, values: Any) -> tuple[Any, Any, Any]:
    """``(acc, m, denom)`` of one chunk. Non-finite values are read as 0 and make NaN
    only the rows that attend them: a page's unused slots may hold anything.

    Whether the values hold one is read from the product, which is small, and not from
    the values: a non-finite value makes the product non-finite where it meets a weight
    (0 included), and only then are the values cleaned and the product made again."""
    # a row that sees no key of the chunk keeps the lowest value as its maximum
    m = finite_or_zero(xp, xp.max(tile.s, axis=-1, keepdims=True))
    p = tile.weights(xp, m)
    with warnings.catch_warnings():  # NumPy's warning for 0 * inf, made right below
        warnings.simplefilter("ignore", RuntimeWarning)
        pv = per_head_matmul(xp, p, values)
    if not values_readable(pv) or not bool(xp.all(xp.isfinite(pv))):
        finite = [xp.isfinite(v) for v in values]
        bad = [cast(xp, xp.any(xp.logical_not(f), axis=-1, keepdims=True), v.dtype)
               for f, v in zip(finite, values, strict=True)]
        clean = [xp.where(f, v, 0.0) for f, v in zip(finite, values, strict=True)]
        pv = attend_values(xp, p, clean, bad, tile,
                           lambda a, b: per_head_matmul(xp, a, b))  # the bits of the above
    return pv, m, xp.sum(p, axis=-1, keepdims=True)


def per_head_matmul(xp: Any, a: Any, b: list[Any]) -> Any:
    """``a (N, Hkv, G, r, x) @ b[h] (N, x, c)`` for each key/value head ``h``, as
    ``(N, Hkv, G, r, c)``: the query heads of a group stacked as the rows of one
    product. (A broadcast over ``G``, or a batch over heads and tiles whose strides do
    not line up, makes torch copy ``b`` first.)"""
    n, hkv, group, rows, inner = a.shape
    parts = [xp.matmul(xp.reshape(a[:, h, ...], (n, group * rows, inner)), b[h])
             for h in range(hkv)]
    return xp.reshape(xp.stack(parts, axis=1), (n, hkv, group, rows, b[0].shape[-1]))


def _merged(xp: Any, state: tuple[Any, Any, Any], step: tuple[Any, Any, Any], pick: Any,
            active: list[int]) -> tuple[Any, Any, Any]:
    """The running ``(acc, m, denom)`` with one chunk's joined, for the tiles that
    read the chunk (``pick``; None: all of them)."""
    acc, m, denom = state
    if pick is not None:
        acc, m, denom = (xp.take(x, pick, axis=0) for x in state)
    s_acc, s_m, s_denom = step
    top = xp.maximum(m, s_m)
    alpha, beta = xp.exp(m - top), xp.exp(s_m - top)
    joined = (acc * alpha + s_acc * beta, top, denom * alpha + s_denom * beta)
    if pick is None:
        return joined
    return tuple(with_rows(xp, whole, active, part) for whole, part in zip(state, joined,
                                                                            strict=True))

