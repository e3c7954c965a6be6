"""Paged calls under ``jax.jit``: the query tiles planned on the device.

Where the block table, the lengths or the query starts are traced, no plan can be
read on the host (:mod:`._paged` uses one). The plan is made on the device instead,
with sizes the shapes fix (:data:`TILE_SIZES`): each sequence's queries are cut into
tiles of 16, and the fewer than 16 before them into at most one tile each of 8, 4, 2
and 1 queries (a decode's one query is a tile of one). So a group of ``T`` queries in
``S`` sequences needs at most ``T // 16`` tiles of 16 and ``min(S, T // r)`` of each
smaller size ``r`` (exactly as many where the starts are concrete, as without
``query_starts``); the tiles past the batch's read nothing, and a group no sequence
needs runs no step. A tile's sequence and rows come from cumulative sums and a search,
the keys it reads from the mask's band (every key of its sequence where the mask has
none; the mask then hides what it must, key by key), and each group runs
:func:`._paged._loop`, the compiled loop of eager calls. So a jitted decode step
compiles once per shape, whatever its lengths.

Values the eager call refuses (lengths past the table, starts that do not run from 0
to ``T``, a sequence with more queries than keys, pages outside the pool) cannot
raise here: they make NaN the rows of the sequences they concern (every row where the
starts are wrong), and bound the loops as if those sequences had no queries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._paged import _loop, _step_keys

if TYPE_CHECKING:
    from portattn.kernel import PagedInputs

__all__ = ["TILE_SIZES", "attend_traced"]

#: The sizes of query tiles, largest first: a sequence's queries are cut into tiles of
#: the largest and at most one of each other size.
TILE_SIZES = (16, 8, 4, 2, 1)


class _Sequences(NamedTuple):
    """On the device: the query starts ``(S + 1,)``; per sequence its queries and its
    keys (both 0 for a sequence whose values are refused); per packed query whether
    its sequence's values are fit."""

    offsets: Any
    counts: Any
    lengths: Any
    fit_rows: Any


class _Tiles(NamedTuple):
    """One group's tiles, on the device: the first packed row and the sequence of
    each, and its keys, first position, queries, first step and steps (``per_tile``,
    what :func:`._paged._loop` reads)."""

    size: int
    rows: Any
    sequence: Any
    per_tile: Any


def attend_traced(call: PagedInputs) -> tuple[Any, Any]:
    """``(out (T, Hq, Dv), lse (Hq, T))`` of a paged call whose lengths, starts or
    table are traced."""
    total, heads = call.query.shape[:2]
    dv = call.value_pages.shape[-1]
    if total == 0:
        return (jnp.zeros((0, heads, dv), dtype=call.query.dtype),
                jnp.zeros((heads, 0), dtype=call.compute_dtype))
    sequences = _checked_sequences(call)
    out = jnp.zeros((total, heads, dv), dtype=call.query.dtype)
    lse = jnp.full((total, heads), -jnp.inf, dtype=call.compute_dtype)
    for tiles in _tile_groups(call, sequences):
        tile_out, tile_lse = _run(call, tiles)
        # each tile row to its packed query; padding rows to T, dropped
        rows = tiles.rows[:, None] + jnp.arange(tiles.size, dtype=jnp.int32)
        used = jnp.arange(tiles.size)[None, :] < tiles.per_tile[2][:, None]
        where = jnp.where(used, rows, total).reshape(-1)
        out = out.at[where].set(tile_out, mode="drop")
        lse = lse.at[where].set(tile_lse, mode="drop")
    refused = ~sequences.fit_rows[:, None]
    out = jnp.where(refused[:, :, None], jnp.nan, out)
    return out, jnp.transpose(jnp.where(refused, jnp.nan, lse))


def _checked_sequences(call: PagedInputs) -> _Sequences:
    """The sequences' extents, checked on the device as the eager call checks them
    on the host; a sequence whose values are refused keeps no query and no key."""
    offsets, lengths = call.query_offsets, call.key_counts
    table = call.block_table
    total, (num_sequences, width) = call.query.shape[0], table.shape
    counts = offsets[1:] - offsets[:-1]
    starts_fit = (offsets[0] == 0) & (offsets[-1] == total) & jnp.all(counts >= 0)
    read = (jnp.arange(width, dtype=jnp.int32)[None, :] * call.page_size
            < lengths[:, None])  # the table entries a sequence reads
    pages_fit = jnp.all(~read | ((table >= 0) & (table < call.key_pages.shape[0])), axis=1)
    fit = (starts_fit & pages_fit & (lengths >= 0) & (lengths <= width * call.page_size)
           & (counts >= 0) & (counts <= lengths))
    sequence_of_row = jnp.searchsorted(offsets[1:], jnp.arange(total), side="right")
    fit_rows = starts_fit & fit[jnp.minimum(sequence_of_row, num_sequences - 1)]
    return _Sequences(offsets, jnp.where(fit, counts, 0), jnp.where(fit, lengths, 0),
                      fit_rows)


def _tile_groups(call: PagedInputs, sequences: _Sequences) -> list[_Tiles]:
    """The groups of tiles, one per size of :data:`TILE_SIZES`, each of as many tiles
    as the batch may need; groups no batch of these shapes needs are left out.

    A sequence's queries past a multiple of the largest size run first, in at most
    one tile of each smaller size (their binary digits), so a group of a smaller size
    holds at most one tile per sequence; a decode's one query is a tile of one."""
    largest = TILE_SIZES[0]
    rest = sequences.counts % largest
    groups = []
    for size, most in zip(TILE_SIZES, _most_tiles(call), strict=True):
        if not most:
            continue
        if size == largest:  # from the sequence's query `rest` on
            per_sequence, first = sequences.counts // largest, rest
        else:  # at most one, after those of the smaller sizes
            per_sequence, first = (rest // size) % 2, rest % size
        groups.append(_tiles(call, sequences, per_sequence, first, size, most))
    return groups


def _most_tiles(call: PagedInputs) -> list[int]:
    """How many tiles of each size of :data:`TILE_SIZES` the batch may need: from the
    starts where they can be read now, else from the shapes alone."""
    total, sequences = call.query.shape[0], call.block_table.shape[0]
    largest = TILE_SIZES[0]
    bounds = [total // largest] + [min(sequences, total // size) for size in TILE_SIZES[1:]]
    if call.query_starts is None:
        return bounds
    counts = np.maximum(np.diff(call.query_starts), 0)
    needed = [int(np.sum(counts // largest))] + [
        int(np.sum((counts % largest) // size % 2)) for size in TILE_SIZES[1:]]
    return [min(b, n) for b, n in zip(bounds, needed, strict=True)]


def _tiles(call: PagedInputs, sequences: _Sequences, per_sequence: Any, first: Any,
           size: int, most: int) -> _Tiles:
    """``most`` tiles of ``size`` queries: sequence ``s`` has ``per_sequence[s]`` of
    them, the first beginning at its query ``first[s]``; tiles past the batch's
    have no queries and no keys."""
    ends = jnp.cumsum(per_sequence)
    tile = jnp.arange(most, dtype=ends.dtype)
    owner = jnp.searchsorted(ends, tile, side="right")
    real = owner < ends.shape[0]
    s = jnp.minimum(owner, ends.shape[0] - 1)
    index = first[s] + (tile - (ends[s] - per_sequence[s])) * size  # in the sequence
    lengths = jnp.where(real, sequences.lengths[s], 0)
    count = jnp.where(real, size, 0)
    position = lengths - sequences.counts[s] + index
    lo, hi = _key_range(call, position, count, lengths)
    step = _step_keys(call.page_size)
    seen = hi > lo
    first_step = jnp.where(seen, lo // step, 0)
    steps = jnp.where(seen, -(-hi // step) - first_step, 0)
    per_tile = jnp.stack([lengths, position, count, first_step, steps]).astype(jnp.int32)
    rows = jnp.where(real, sequences.offsets[s] + index, 0)
    return _Tiles(size, rows.astype(jnp.int32), s.astype(jnp.int32), per_tile)


def _key_range(call: PagedInputs, position: Any, count: Any, lengths: Any) -> tuple[Any, Any]:
    """The keys ``[lo, hi)`` that queries at ``[position, position + count)`` of
    sequences of ``lengths`` keys may see, by the mask's band (query ``i`` sees key
    ``j`` only where ``lower <= j - i <= upper``): all of them where it has none."""
    band = None if call.mask is None else call.mask.band(0, 0)
    lo = jnp.zeros_like(position) if band is None or band.lower is None else (
        position + band.lower)
    hi = lengths if band is None or band.upper is None else position + count + band.upper
    return jnp.clip(lo, 0, lengths), jnp.clip(hi, 0, lengths)


def _run(call: PagedInputs, tiles: _Tiles) -> tuple[Any, Any]:
    """``(out (N * size, Hq, Dv), lse (N * size, Hq))`` of one group of tiles: the
    compiled loop, and its careful form where a value it read was not finite."""
    total = call.query.shape[0]
    reads = tiles.rows[:, None] + jnp.arange(tiles.size, dtype=jnp.int32)
    reads = jnp.minimum(reads, total - 1).reshape(-1)  # padding rows: any row
    page_count = call.key_pages.shape[0]
    table = jnp.clip(jnp.take(call.block_table, tiles.sequence, axis=0), 0, page_count - 1)
    if table.shape[1] == 0:  # no sequence has a key: one column the lengths hide
        table = jnp.zeros((table.shape[0], 1), dtype=table.dtype)

    def of_tiles(values: Any) -> Any:  # (S, Hq) per sequence -> per tile
        return None if values is None else jnp.take(values, tiles.sequence, axis=0)

    def loop(careful: bool) -> tuple[Any, Any, Any]:
        return _loop(jnp.take(call.query, reads, axis=0), call.key_pages,
                     call.value_pages, table, tiles.per_tile, of_tiles(call.alibi_slopes),
                     of_tiles(call.sinks), call.mask, size=tiles.size,
                     chunk_pages=_step_keys(call.page_size) // call.page_size,
                     head_major=call.head_major, scale=call.scale, softcap=call.softcap,
                     careful=careful)

    out, lse, finite = loop(careful=False)
    return jax.lax.cond(finite, lambda: (out, lse), lambda: loop(careful=True)[:2])
