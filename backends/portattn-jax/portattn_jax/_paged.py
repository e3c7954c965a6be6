"""Paged calls on JAX: each size of query tile runs one compiled loop over its chunks
of pages.

The host plans the call's query tiles (:meth:`PagedInputs.query_tiles`: a tile's
sequence, positions and the chunks of keys it may see). Each group of tiles of one
size is one jitted function: a ``lax`` loop in which every tile reads its next chunk of
pages from the pools through its row of the block table (a gather of one chunk, never
a sequence whole) and joins it to an online softmax. The loop runs as many chunks as
the longest tile needs, a traced bound; the tiles and the table's width are padded to
powers of two, so a decode loop whose batch and lengths change every step compiles a
handful of times, not once a step.
"""

from __future__ import annotations

import math
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
    total, heads = call.query.shape[:2]
    ct = jnp.float64 if call.query.dtype == jnp.float64 else jnp.float32
    out = jnp.zeros((total, heads, call.value_pages.shape[-1]), dtype=call.query.dtype)
    lse = jnp.full((total, heads), -math.inf, dtype=ct)
    for tiles in call.query_tiles():
        rows, reads, args = _tile_arguments(call, tiles)
        # the queries gathered here: the loop's shapes do not follow the batch's
        tile_out, tile_lse = _loop(
            jnp.take(call.query, reads, axis=0), call.key_pages, call.value_pages, *args,
            call.mask,
            size=tiles.size, chunk_pages=_step_keys(call.page_size) // call.page_size,
            head_major=call.head_major, scale=call.scale, softcap=call.softcap)
        # every packed query is one row of one tile; padding rows point past the end
        out = out.at[rows].set(tile_out, mode="drop")
        lse = lse.at[rows].set(tile_lse, mode="drop")
    return out, jnp.transpose(lse)


#: Keys a tile reads per loop step (whole pages, at least one): smaller than the
#: portable loop's chunks, as XLA's gather and products ran fastest on CPUs at 64.
STEP_KEYS = 64


def _step_keys(page_size: int) -> int:
    return max(1, STEP_KEYS // page_size) * page_size


def _bucket(n: int) -> int:
    """``n`` rounded up to a power of two: the shapes a loop is compiled for."""
    return 1 << max(0, n - 1).bit_length()


def _tile_arguments(call: PagedInputs,
                    tiles: QueryTiles) -> tuple[Any, Any, tuple[Any, ...]]:
    """The tiles' packed rows (padding: ``T``, dropped), the rows they read (padding:
    the last), and the loop's arguments: block-table rows, key lengths, first
    positions, query counts, first steps, steps each, the most steps, ALiBi slopes and
    sinks, for the tiles padded to a power of two (padding tiles have no queries and
    no keys)."""
    total = call.query.shape[0]
    n, size = len(tiles.sequence), tiles.size
    padded = _bucket(n)
    extra = padded - n
    rows = np.full((padded, size), total, dtype=np.int32)
    for t, (start, count) in enumerate(zip(tiles.rows, tiles.count, strict=True)):
        rows[t, :count] = np.arange(start, start + count)
    rows = rows.reshape(-1)
    sequence = np.asarray(tiles.sequence + [0] * extra, dtype=np.int32)
    host = np.asarray(call.host_table)
    table = np.zeros((padded, _bucket(host.shape[1])), dtype=np.int32)
    table[:n, :host.shape[1]] = np.maximum(host[sequence[:n]], 0)  # -1: unused, hidden
    lengths = np.asarray(call.key_lengths, dtype=np.int32)[sequence]
    lengths[n:] = 0
    # the plan's chunks in the loop's smaller steps (the first step may start early)
    chunk, step = call.chunk_keys, _step_keys(call.page_size)
    first = [c * chunk // step for c in tiles.first]
    spans = np.asarray([-(-c * chunk // step) - f for c, f in zip(tiles.stop, first,
                                                                  strict=True)], np.int32)

    def ints(values: Any) -> Any:
        return jnp.asarray(np.asarray(values, dtype=np.int32))

    def per_tile(values: Any) -> Any:
        return None if values is None else jnp.take(values, jnp.asarray(sequence), axis=0)

    args = (ints(table), ints(lengths),
            ints(tiles.position + [0] * extra), ints(tiles.count + [0] * extra),
            ints(first + [0] * extra), ints(list(spans) + [0] * extra),
            ints(spans.max(initial=0)), per_tile(call.alibi_slopes), per_tile(call.sinks))
    return jnp.asarray(rows), ints(np.minimum(rows, total - 1)), args


@partial(jax.jit, static_argnames=("size", "chunk_pages", "head_major", "scale",
                                   "softcap"))
def _loop(query: Any, key_pages: Any, value_pages: Any, table: Any, lengths: Any,
          position: Any, count: Any, first: Any, spans: Any, most: Any, slopes: Any,
          sinks: Any, mask: Any, *, size: int, chunk_pages: int, head_major: bool,
          scale: float, softcap: float | None) -> tuple[Any, Any]:
    """``(out (N * size, Hq, Dv), lse (N * size, Hq))`` of ``N`` tiles of ``size``
    queries ``query`` (traced; compiled once per shape and static argument)."""
    ct = jnp.float64 if query.dtype == jnp.float64 else jnp.float32
    low = float(jnp.finfo(ct).min)
    n = table.shape[0]
    heads, dim = query.shape[1:]
    hkv = key_pages.shape[1 if head_major else 2]
    page = key_pages.shape[2 if head_major else 1]
    group, width, keys = heads // hkv, table.shape[1], chunk_pages * page
    dv = value_pages.shape[-1]

    def einsum(spec: str, a: Any, b: Any) -> Any:
        return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)

    q = query.astype(ct) * scale  # (N * size, Hq, D): the tiles' rows
    q = jnp.transpose(jnp.reshape(q, (n, size, hkv, group, dim)), (0, 2, 3, 1, 4))
    positions = position[:, None] + jnp.arange(size, dtype=jnp.int32)  # (N, size)
    real = jnp.arange(size, dtype=jnp.int32)[None, :] < count[:, None]
    alibi = None if slopes is None else jnp.reshape(slopes.astype(ct), (n, hkv, group, 1, 1))

    def read(pool: Any, pages: Any) -> Any:
        """``(N, keys, Hkv, D)``: each tile's chunk of pages, end to end."""
        x = jnp.take(pool, pages, axis=0)  # (N, chunk_pages, ...) a page each
        if head_major:  # (P, Hkv, page, D)
            x = jnp.transpose(x, (0, 1, 3, 2, 4))
        return jnp.reshape(x, (n, keys, hkv, pool.shape[-1])).astype(ct)

    def chunk(i: Any, state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        acc, m, denom = state
        c = first + i  # (N,) each tile's chunk
        columns = c[:, None] * chunk_pages + jnp.arange(chunk_pages, dtype=jnp.int32)
        # past the table's width: page 0, hidden by the length
        pages = jnp.take_along_axis(table, jnp.minimum(columns, width - 1), axis=1)
        k, v = read(key_pages, pages), read(value_pages, pages)
        slot = c[:, None] * keys + jnp.arange(keys, dtype=jnp.int32)  # (N, keys)
        s = einsum("nhgrd,nkhd->nhgrk", q, k)
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
        pv = einsum("nhgrk,nkhd->nhgrd", p, v)

        def nonfinite_values(_: Any) -> Any:
            # NaN only for rows that attend a non-finite value; unused slots hold anything
            finite = jnp.isfinite(v)
            clean = einsum("nhgrk,nkhd->nhgrd", p, jnp.where(finite, v, 0.0))
            bad = jnp.any(~finite, axis=-1, keepdims=True).astype(ct)
            visible = (allowed & ~jnp.isneginf(s)).astype(ct)
            attended = einsum("nhgrk,nkhd->nhgrd", visible, bad) > 0
            return jnp.where(attended, jnp.nan, clean)

        pv = jax.lax.cond(jnp.all(jnp.isfinite(pv)), lambda _: pv, nonfinite_values, None)
        joined = jnp.maximum(m, top)
        alpha, beta = jnp.exp(m - joined), jnp.exp(top - joined)
        return (acc * alpha + pv * beta, joined,
                denom * alpha + jnp.sum(p, axis=-1, keepdims=True) * beta)

    shape = (n, hkv, group, size)
    state = (jnp.zeros((*shape, dv), dtype=ct), jnp.full((*shape, 1), low, dtype=ct),
             jnp.zeros((*shape, 1), dtype=ct))
    acc, m, denom = jax.lax.fori_loop(0, most, chunk, state)
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
    return out.astype(query.dtype), lse
