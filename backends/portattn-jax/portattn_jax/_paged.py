"""Paged calls on JAX: each size of query tile runs one compiled loop over its chunks
of pages.

The host plans the call's query tiles (:meth:`PagedInputs.query_tiles`: a tile's
sequence, positions and the chunks of keys it may see). Each group of tiles of one
size is one jitted function: a ``lax`` loop in which every tile reads its next chunk of
pages from the pools through its row of the block table (a gather of one chunk, never
a sequence whole) and joins it to an online softmax. The loop runs as many chunks as
the longest tile needs, a traced bound; the tiles and the table's width are padded to
powers of two, so a decode loop whose batch and lengths change every step compiles a
handful of times, not once a step. Under ``jax.jit``, where the lengths, starts or
table are traced, :mod:`._paged_device` plans the tiles on the device and runs the
same loop.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from portattn.kernel import PagedInputs, QueryTiles

__all__ = ["attend_pages"]


def attend_pages(call: PagedInputs) -> tuple[Any, Any]:
    """``(out (T, Hq, Dv), lse (Hq, T))`` of the paged call ``call``."""
    groups = call.query_tiles()
    if not groups:  # no queries
        heads = call.query.shape[1]
        return (jnp.zeros((0, heads, call.value_pages.shape[-1]), dtype=call.query.dtype),
                jnp.zeros((heads, 0), dtype=call.compute_dtype))
    loops = [_tile_loop(call, tiles) for tiles in groups]
    results = [loop(careful=False) for loop in loops]
    where = jnp.asarray(_placement(call.query.shape[0], groups))
    out, lse = _assembled(results, where)  # queued behind the loops, before the check
    if not all(bool(finite) for _, _, finite in results):
        # a value read was not finite: the careful loop where it was
        results = [r if bool(r[2]) else loop(careful=True)
                   for r, loop in zip(results, loops, strict=True)]
        out, lse = _assembled(results, where)
    return out, lse


def _assembled(results: list[tuple[Any, Any, Any]], where: Any) -> tuple[Any, Any]:
    """The tiles' rows, in the packed queries' order."""
    outs, lses = [r[0] for r in results], [r[1] for r in results]
    out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses) if len(lses) > 1 else lses[0]
    return jnp.take(out, where, axis=0), jnp.transpose(jnp.take(lse, where, axis=0))


def _placement(total: int, groups: list[QueryTiles]) -> Any:
    """For each packed query, its row among the groups' tile rows end to end (each
    group padded to a power of two of tiles)."""
    where = np.zeros(total, dtype=np.int32)
    offset = 0
    for tiles in groups:
        for t, (start, count) in enumerate(zip(tiles.rows, tiles.count, strict=True)):
            first = offset + t * tiles.size
            where[start:start + count] = np.arange(first, first + count)
        offset += _bucket(len(tiles.sequence)) * tiles.size
    return where


#: Keys a tile reads per loop step (whole pages, at least one): smaller than the
#: portable loop's chunks, as XLA's gather and products ran fastest on CPUs at 64.
STEP_KEYS = 64


def _step_keys(page_size: int) -> int:
    return max(1, STEP_KEYS // page_size) * page_size


def _bucket(n: int) -> int:
    """``n`` rounded up to a power of two: the shapes a loop is compiled for."""
    return 1 << max(0, n - 1).bit_length()


def _tile_loop(call: PagedInputs, tiles: QueryTiles) -> Any:
    """The compiled loop of tiles of one size, its arguments bound (tiles padded to a
    power of two: padding tiles have no queries and no keys), ``careful`` left open."""
    total = call.query.shape[0]
    n, size = len(tiles.sequence), tiles.size
    padded = _bucket(n)
    reads = np.full((padded, size), total - 1, dtype=np.int32)  # padding: any row
    for t, (start, count) in enumerate(zip(tiles.rows, tiles.count, strict=True)):
        reads[t, :count] = np.arange(start, start + count)
    sequence = np.zeros(padded, dtype=np.int32)
    sequence[:n] = tiles.sequence
    host = np.asarray(call.host_table)
    table = np.zeros((padded, _bucket(host.shape[1])), dtype=np.int32)
    table[:n, :host.shape[1]] = np.maximum(host[sequence[:n]], 0)  # -1: unused, hidden
    # per tile: keys, first position, queries, first step, steps (the plan's chunks in
    # the loop's smaller steps; the first step may start early)
    chunk, step = call.chunk_keys, _step_keys(call.page_size)
    per_tile = np.zeros((5, padded), dtype=np.int32)
    per_tile[0, :n] = np.asarray(call.key_lengths)[sequence[:n]]
    per_tile[1, :n], per_tile[2, :n] = tiles.position, tiles.count
    per_tile[3, :n] = np.asarray(tiles.first) * chunk // step
    per_tile[4, :n] = -(-np.asarray(tiles.stop) * chunk // step) - per_tile[3, :n]

    def of_tiles(values: Any) -> Any:  # (S, Hq) per sequence -> per tile
        return None if values is None else jnp.take(values, jnp.asarray(sequence), axis=0)

    # the queries gathered here: the loop's shapes do not follow the batch's
    return partial(_loop, jnp.take(call.query, jnp.asarray(reads.reshape(-1)), axis=0),
                   call.key_pages, call.value_pages, jnp.asarray(table),
                   jnp.asarray(per_tile), of_tiles(call.alibi_slopes), of_tiles(call.sinks),
                   call.mask, size=size, chunk_pages=step // call.page_size,
                   head_major=call.head_major, scale=call.scale, softcap=call.softcap)


@partial(jax.jit, static_argnames=("size", "chunk_pages", "head_major", "scale",
                                   "softcap", "careful"))
def _loop(query: Any, key_pages: Any, value_pages: Any, table: Any, per_tile: Any,
          slopes: Any, sinks: Any, mask: Any, *, size: int, chunk_pages: int, head_major: bool,
          scale: float, softcap: float | None, careful: bool) -> tuple[Any, Any, Any]:
    """``(out (N * size, Hq, Dv), lse (N * size, Hq), finite)`` of ``N`` tiles of
    ``size`` queries ``query`` (traced; compiled once per shape and static argument);
    ``per_tile`` holds each tile's keys, first position, queries, first step and steps.

    ``finite`` says whether the accumulated outputs are: a product of weights and
    values that was not would have made them so. Then a value a step read was not (an
    unused slot may hold anything), and the ``careful`` loop gives NaN only to the rows
    that attend such a value. (A branch in each step, or a check of each product,
    cost a third of the step on CPUs.)"""
    ct = jnp.float64 if query.dtype == jnp.float64 else jnp.float32
    low = float(jnp.finfo(ct).min)
    n = table.shape[0]
    heads, dim = query.shape[1:]
    hkv = key_pages.shape[1 if head_major else 2]
    page = key_pages.shape[2 if head_major else 1]
    group, width, keys = heads // hkv, table.shape[1], chunk_pages * page
    dv = value_pages.shape[-1]
    lengths, position, count, first, spans = per_tile

    def einsum(spec: str, a: Any, b: Any) -> Any:
        return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)

    q = query.astype(ct) * scale  # (N * size, Hq, D): the tiles' rows
    q = jnp.transpose(jnp.reshape(q, (n, size, hkv, group, dim)), (0, 2, 3, 1, 4))
    positions = position[:, None] + jnp.arange(size, dtype=jnp.int32)  # (N, size)
    real = jnp.arange(size, dtype=jnp.int32)[None, :] < count[:, None]
    alibi = None if slopes is None else jnp.reshape(slopes.astype(ct), (n, hkv, group, 1, 1))

    # the products read each tile's pages as gathered, (N, pages, page, Hkv, D) or
    # (N, pages, Hkv, page, D): no transpose (it cost XLA a copy of the chunk)
    pages_of = "ncphd" if not head_major else "nchpd"

    def read(pool: Any, pages: Any) -> Any:
        return jnp.take(pool, pages, axis=0).astype(ct)

    def scores(q: Any, k: Any) -> Any:
        return jnp.reshape(einsum(f"nhgrd,{pages_of}->nhgrcp", q, k), (*q.shape[:-1], keys))

    def weighted(p: Any, v: Any) -> Any:
        p = jnp.reshape(p, (*p.shape[:-1], chunk_pages, page))
        return einsum(f"nhgrcp,{pages_of}->nhgrd", p, v)

    def chunk(i: Any, state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        acc, m, denom = state
        c = first + i  # (N,) each tile's chunk
        columns = c[:, None] * chunk_pages + jnp.arange(chunk_pages, dtype=jnp.int32)
        # past the table's width: page 0, hidden by the length
        pages = jnp.take_along_axis(table, jnp.minimum(columns, width - 1), axis=1)
        k, v = read(key_pages, pages), read(value_pages, pages)
        slot = c[:, None] * keys + jnp.arange(keys, dtype=jnp.int32)  # (N, keys)
        s = scores(q, k)
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        if alibi is not None:
            distance = jnp.abs(positions[:, :, None] - slot[:, None, :]).astype(ct)
            s = s - alibi * distance[:, None, None]
        allowed = (real[:, :, None] & (slot[:, None, :] < lengths[:, None, None])
                   & (i < spans)[:, None, None])
        if mask is not None:
            allowed = allowed & mask.allows(jnp, 0, 0, positions[:, :, None],
                                            slot[:, None, :], 0, 0)
        allowed = allowed[:, None, None]
        s = jnp.where(allowed, s, low)
        top = jnp.max(s, axis=-1, keepdims=True)
        top = jnp.where(jnp.isneginf(top), 0.0, top)
        p = jnp.where(allowed, jnp.exp(jnp.where(allowed, s - top, 0.0)), 0.0)
        if careful:
            readable = jnp.isfinite(v)
            bad = jnp.any(~readable, axis=-1, keepdims=True).astype(ct)
            attended = weighted((allowed & ~jnp.isneginf(s)).astype(ct), bad) > 0
            pv = jnp.where(attended, jnp.nan, weighted(p, jnp.where(readable, v, 0.0)))
        else:
            pv = weighted(p, v)
        joined = jnp.maximum(m, top)
        alpha, beta = jnp.exp(m - joined), jnp.exp(top - joined)
        return (acc * alpha + pv * beta, joined,
                denom * alpha + jnp.sum(p, axis=-1, keepdims=True) * beta)

    shape = (n, hkv, group, size)
    state = (jnp.zeros((*shape, dv), dtype=ct), jnp.full((*shape, 1), low, dtype=ct),
             jnp.zeros((*shape, 1), dtype=ct))
    acc, m, denom = jax.lax.fori_loop(0, jnp.max(spans), chunk, state)
    finite = jnp.all(jnp.isfinite(acc))
    if sinks is not None:
        sink = jnp.reshape(sinks.astype(ct), (n, hkv, group, 1, 1))
        top = jnp.maximum(m, sink)
        alpha = jnp.exp(m - top)
        acc, m, denom = acc * alpha, top, denom * alpha + jnp.exp(sink - top)
    has_mass = denom > 0
    safe = jnp.where(has_mass, denom, 1.0)
    out = acc / safe
    lse = jnp.where(has_mass, m + jnp.log(safe), -jnp.inf)[..., 0]
    out = jnp.reshape(jnp.transpose(out, (0, 3, 1, 2, 4)), (n * size, heads, dv))
    lse = jnp.reshape(jnp.transpose(lse, (0, 3, 1, 2)), (n * size, heads))
    return out.astype(query.dtype), lse, finite
