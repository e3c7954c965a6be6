"""The mask on the chunk grid: which blocks to schedule, and the mask of each one.

A graph is fixed when it is built, so skipping blocks needs the mask's block form then.
Positional kinds need no values. The arrays of the other kinds are small next to the
query (lengths, ranges and global positions per batch element, segment ids per
position, one boolean per layout cell): they are read with one ``dask.compute`` when the
graph is built, and the graph then holds these values instead of the arrays' own
graphs (so they are computed once, and the blocks compute exactly what was planned).
Mask functions are evaluated then, on NumPy index arrays (every pair, as for any
kernel; kept on the mask object). Dense masks hold a boolean per pair: they are never
read here; their blocks count as partial and each task reads its own chunk.

The block form comes from the kinds themselves (``Mask.block_states`` on the grid of
the chunk boundaries, uneven as Dask's chunks are), per batch element and head where
it varies; a block of batch and head chunks is skipped when every element and head in
it hides it, and runs without a mask when every one sees all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace

from portattn import masks

from ._layout import bounds
from ._parts import Place, places
from ._recipe import Block, Recipe, recipe

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

    from ._layout import Layout

__all__ = ["ChunkMasks", "chunk_masks"]


@dataclass
class ChunkMasks:
    """The mask of one call on its chunk grid (``mask`` None: every block full)."""

    inputs: AttentionInputs
    layout: Layout
    mask: masks.Mask | None
    """Bound to the call on the host: read values, dense parts still lazy."""
    states: Any
    """``(*batch | 1, H | 1, n_q, n_k)`` over the non-empty query and key chunks."""
    q_rows: dict[int, int]
    k_cols: dict[int, int]
    """Row (column) of ``states`` of each non-empty query (key) chunk."""
    _per_chunk: dict = field(default_factory=dict)

    @property
    def read(self) -> tuple[Any, ...]:
        """The values read from the mask's arrays (dense ones excepted)."""
        if self.mask is None:
            return ()
        return tuple(a for a, p in zip(self.mask.arrays, places(self.mask), strict=True)
                     if not p.pairs)

    def key_blocks(self, b: tuple[int, ...], h: int, i: int) -> list[tuple[int, bool]]:
        """``(key chunk, full)`` of every key chunk that query block ``(*b, h, i)`` must
        visit, in order; full: every pair of it is allowed (no mask needed)."""
        if i not in self.q_rows:
            return []
        if self.mask is None:
            return [(j, True) for j in self.k_cols]
        some, every, _ = self._chunk(b, h)
        row = self.q_rows[i]
        return [(j, bool(every[row, col])) for j, col in self.k_cols.items() if some[row, col]]

    def _chunk(self, b: tuple[int, ...], h: int) -> tuple[Any, Any, masks.Mask]:
        """For batch and head chunk ``(b, h)``: which tiles some element and head sees,
        which all see completely, and the mask with the chunk's slices of the arrays."""
        key = (*b, h)
        if key not in self._per_chunk:
            spans = self._spans(b, h)
            states = self.states[tuple(slice(*s) if n > 1 else slice(None)
                                       for s, n in zip(spans, self.states.shape[:-2],
                                                       strict=True))]
            lead = tuple(range(states.ndim - 2))
            some = states.max(axis=lead) != masks.HIDDEN
            every = states.min(axis=lead) == masks.FULL
            sub = self.mask.with_arrays([_slice(a, p, spans)
                                         for a, p in zip(self.mask.arrays, places(self.mask),
                                                         strict=True)])
            self._per_chunk[key] = some, every, sub
        return self._per_chunk[key]

    def _spans(self, b: tuple[int, ...], h: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of chunk ``(*b, h)`` along each batch axis and the heads."""
        chunks = (*self.layout.batch_chunks, self.layout.head_chunks)
        return [bounds(c)[index] for c, index in zip(chunks, (*b, h), strict=True)]

    def recipe(self, b: tuple[int, ...], h: int, q0: int, q1: int, k0: int, k1: int
               ) -> Recipe:
        """The mask of queries ``[q0, q1)`` and keys ``[k0, k1)`` of batch and head
        chunk ``(*b, h)``, ready to travel."""
        inputs = self.inputs
        spans = self._spans(b, h)
        _, _, sub = self._chunk(b, h)
        (h0, h1), batch = spans[-1], spans[:-1]
        block = Block(inputs.batch_shape, tuple(stop - start for start, stop in batch),
                      tuple(start for start, _ in batch), h0, h1 - h0, q1 - q0, k1 - k0)
        return recipe(sub.restrict(_numpy(), q0, q1, k0, k1, inputs.q_len, inputs.kv_len), block)


def chunk_masks(inputs: AttentionInputs, layout: Layout) -> ChunkMasks:
    """Read the mask's small arrays (one ``dask.compute``) and classify every block."""
    import numpy as np

    q_rows = _nonempty(layout.q_chunks)
    k_cols = _nonempty(layout.k_chunks)
    if inputs.mask is None or not q_rows or not k_cols:
        return ChunkMasks(inputs, layout, None, None, q_rows, k_cols)
    mask = _host_mask(inputs)
    grid = masks.Grid(_edges(layout.q_chunks, q_rows), _edges(layout.k_chunks, k_cols),
                      inputs.q_len, inputs.kv_len)
    shape = (len(q_rows), len(k_cols))
    states = mask.block_states(grid)
    if states is None:  # nothing known: every block partial
        states = np.full(shape, masks.PARTIAL, dtype=np.int8)
    lead = len(inputs.batch_shape) + 1
    states = states.reshape((1,) * (lead + 2 - states.ndim) + states.shape)
    states = np.broadcast_to(states, (*states.shape[:-2], *shape))
    return ChunkMasks(inputs, layout, mask, states, q_rows, k_cols)


def _host_mask(inputs: AttentionInputs) -> masks.Mask:
    """The call's mask bound again, on the host, to the values of its small arrays."""
    mask = inputs.mask
    arrays = list(mask.arrays)
    found = places(mask)
    small = [n for n, p in enumerate(found) if not p.pairs]
    if small:
        values = _compute([arrays[n] for n in small])
        for n, value in zip(small, values, strict=True):
            arrays[n] = _batch_wide(_host(value), found[n], inputs.batch_shape)
    # for_call, not bind: the values were just read (copies already), and the dense
    # arrays stay lazy, to be read block by block
    return mask.with_arrays(arrays).for_call(_numpy(), inputs.batch_shape, inputs.num_heads,
                                             inputs.q_len, inputs.kv_len)


def _compute(arrays: list[Any]) -> tuple[Any, ...]:
    """The values of ``arrays``, computed together: by the client of a cluster when they
    hold its results (persisted arrays; it need not be the default client), else by
    Dask's current scheduler."""
    import sys

    import dask

    distributed = sys.modules.get("distributed")  # results of a cluster import it first
    futures = [] if distributed is None else distributed.futures_of(arrays)
    if futures:
        return tuple(futures[0].client.compute(arrays, sync=True))
    return dask.compute(*arrays)


def _numpy() -> Any:
    import numpy as np

    return array_namespace(np.empty(0))


def _host(a: Any) -> Any:
    """A computed chunk-library array as a NumPy array."""
    import numpy as np

    try:
        return np.asarray(a)
    except TypeError:  # a device array (CuPy) that will not convert implicitly
        from array_api_compat import to_device

        return np.asarray(to_device(a, "cpu"))


def _batch_wide(a: Any, place: Place, batch: tuple[int, ...]) -> Any:
    """``a`` with its batch axes at full size (ids shared by the batch become a row per
    element: a block of batch elements must hold its own rows)."""
    import numpy as np

    axes = min(place.lead, len(batch))
    return np.broadcast_to(a, (*batch[:axes], *a.shape[axes:]))


def _slice(a: Any, place: Place, spans: list[tuple[int, int]]) -> Any:
    """The slice of one host array for a chunk of batch elements and heads; a dense
    array becomes an all-True stand-in of that size (restrict cuts it, and the task
    puts the block's chunk of the real one in its place)."""
    import numpy as np

    index = tuple(slice(*span) if size > 1 else slice(None)
                  for span, size in zip(spans, a.shape[:place.lead], strict=False))
    if place.pairs:
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, a.shape, strict=False))
        return np.broadcast_to(np.True_, (*shape, *a.shape[len(index):]))
    return a[index]


def _nonempty(chunks: tuple[int, ...]) -> dict[int, int]:
    """Index among the non-empty chunks of each non-empty chunk."""
    kept = [n for n, size in enumerate(chunks) if size]
    return {n: row for row, n in enumerate(kept)}


def _edges(chunks: tuple[int, ...], kept: dict[int, int]) -> Any:
    import numpy as np

    spans = [bounds(chunks)[n] for n in kept]
    return np.asarray([start for start, _ in spans] + [spans[-1][1]])
