"""Lining up the chunks of every array of one call, so blocks pair up one to one.

Chunks are the caller's decision, as everywhere in Dask: this module rechunks only
where a block could not be computed otherwise.

- The head dims ``D`` and ``Dv`` become one chunk (a dot product needs the whole row).
- The query's chunks drive the batch, head and query-length axes; the key's chunks
  drive the key-length axis. Key and value follow them.
- Grouped-query attention: query-head chunk boundaries move down to multiples of the
  group size, so every chunk holds whole groups, and K/V heads are chunked by group.
- Bias and dense masks are rechunked to the same blocks, ALiBi slopes and sinks to
  the batch and head chunks (their size-1 broadcast axes stay one chunk). The mask's
  other arrays are small: :mod:`portattn_dask._chunk_masks` reads them when the graph
  is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING, Any

from ._parts import places

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["Layout", "align", "block_index", "bounds", "group_aligned"]


@dataclass(frozen=True)
class Layout:
    """The call's arrays, rechunked so that block ``(*b, h, i)`` of the query meets
    block ``(*b, h, j)`` of key and value (``h`` counting query-head chunks)."""

    query: Any
    key: Any
    value: Any
    bias: Any
    dense: tuple[Any, ...]
    """The mask's dense arrays, in the order of ``mask.arrays``, rechunked to the blocks."""
    alibi_slopes: Any
    sinks: Any
    """``(*batch | 1, Hq)``, rechunked to the batch and head chunks (or None)."""

    @property
    def batch_chunks(self) -> tuple[tuple[int, ...], ...]:
        return self.query.chunks[:-3]

    @property
    def head_chunks(self) -> tuple[int, ...]:
        return self.query.chunks[-3]

    @property
    def q_chunks(self) -> tuple[int, ...]:
        return self.query.chunks[-2]

    @property
    def k_chunks(self) -> tuple[int, ...]:
        return self.key.chunks[-2]


def group_aligned(chunks: tuple[int, ...], group: int) -> tuple[int, ...]:
    """Chunks of the query-head axis with every boundary a multiple of ``group``.

    Each boundary moves down to the nearest multiple, so ``(3, 3, 2)`` with groups of 4
    becomes ``(4, 4)``.
    """
    total = sum(chunks)
    if group < 1:  # no query heads at all: nothing to align
        return chunks
    cuts = sorted({0, total} | {b - b % group for b in accumulate(chunks)})
    return tuple(hi - lo for lo, hi in pairwise(cuts)) or (total,)


def bounds(chunks: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of consecutive chunks."""
    stops = list(accumulate(chunks))
    return [(stop - size, stop) for size, stop in zip(chunks, stops, strict=True)]


def block_index(array: Any, index: tuple[int, ...]) -> tuple[int, ...]:
    """The block of ``array`` that meets block ``index`` (0 on broadcast axes)."""
    return tuple(i if n > 1 else 0 for i, n in zip(index, array.numblocks, strict=True))


def align(inputs: AttentionInputs) -> Layout:
    """The arrays of one call, rechunked so their blocks pair up."""
    nb = len(inputs.batch_shape)
    query = inputs.query
    batch = query.chunks[:nb]
    heads = group_aligned(query.chunks[nb], inputs.group_size)
    kv_heads = tuple(h // inputs.group_size for h in heads)
    q_len, k_len = query.chunks[nb + 1], inputs.key.chunks[nb + 1]

    query = query.rechunk((*batch, heads, q_len, -1))
    key = inputs.key.rechunk((*batch, kv_heads, k_len, -1))
    value = inputs.value.rechunk((*batch, kv_heads, k_len, -1))
    scores = (*batch, heads, q_len, k_len)  # the chunks of a full-rank score array

    bias = None if inputs.bias is None else _match(inputs.bias, scores)
    arrays = () if inputs.mask is None else inputs.mask.arrays
    # dense masks are full rank, like the bias
    dense = tuple(_match(a, scores) for a, place in zip(arrays, places(inputs.mask),
                                                         strict=True) if place.pairs)
    per_head = [None if a is None else _match(a, (*batch, heads))
                for a in (inputs.alibi_slopes, inputs.sinks)]
    return Layout(query, key, value, bias, dense, *per_head)


def _match(array: Any, chunks: tuple[tuple[int, ...], ...]) -> Any:
    """``array`` rechunked to ``chunks``, keeping its broadcast (size-1) axes whole."""
    import dask.array as da

    array = da.asarray(array)
    target = tuple(c if size != 1 else (1,) for size, c in zip(array.shape, chunks, strict=True))
    return array.rechunk(target)
