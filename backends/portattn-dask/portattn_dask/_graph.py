"""The lazy graph of one attention call.

For every query block ``(*batch, heads, query rows)`` the structured mask tells which
key blocks it can reach at all; each reachable pair is one task, a query block split
over several key blocks gets one merge task (split-KV), and a block that reaches no
key gets one task making zeros. Unreachable pairs are never scheduled, so the graph
holds at most ``query blocks x (key blocks + 3)`` tasks of its own.
"""

from __future__ import annotations

from itertools import product
from operator import getitem
from typing import TYPE_CHECKING, Any

from ._block import ChunkCall, attend, empty, merge_blocks
from ._layout import Layout, align, block_index, bounds

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs
    from portattn.masks import Mask

__all__ = ["blockwise_attention", "reachable"]


def reachable(mask: Mask | None, q0: int, q1: int, k_bounds: list[tuple[int, int]],
              lq: int, lk: int) -> list[int]:
    """Indices of the key blocks that some query in ``[q0, q1)`` may attend."""
    if q1 <= q0:
        return []
    lo, hi = (0, lk) if mask is None else mask.key_range(q0, q1, lq, lk)
    return [j for j, (k0, k1) in enumerate(k_bounds) if max(k0, lo) < min(k1, hi)]


def blockwise_attention(inputs: AttentionInputs) -> tuple[Any, Any]:
    """Lazy ``(out, lse)`` Dask arrays (``lse`` None unless asked)."""
    from dask.base import tokenize

    layout = align(inputs)
    call = ChunkCall(inputs.scale, inputs.softcap, inputs.q_len, inputs.kv_len,
                     inputs.value_head_dim, layout.mask)
    token = tokenize(layout.query, layout.key, layout.value, layout.bias, layout.mask_arrays,
                     [repr(m) for m in layout.mask], inputs.scale, inputs.softcap,
                     inputs.return_lse, tuple(call.overrides))
    names = {part: f"attention-{part}-{token}"
             for part in ("block", "merge", "zeros", "out", "lse")}
    blocks, outs, lses = _tasks(inputs, layout, call, names)
    deps = [a for a in (layout.query, layout.key, layout.value, layout.bias,
                        *layout.mask_arrays) if a is not None]
    chunks = (*layout.batch_chunks, layout.head_chunks, layout.q_chunks)
    out = _array(blocks, deps, names, "out", outs, (*chunks, (inputs.value_head_dim,)),
                 layout.query, inputs.query.dtype)
    lse = None
    if inputs.return_lse:
        lse = _array(blocks, deps, names, "lse", lses, chunks, layout.query,
                     inputs.compute_dtype)
    return out, lse


def _tasks(inputs: AttentionInputs, layout: Layout, call: ChunkCall, names: dict[str, str]
           ) -> tuple[dict, dict, dict]:
    """The block layer (attention, merge and zeros tasks) and the two output layers."""
    from dask.task_spec import Task

    blocks: dict = {}
    outs: dict = {}
    lses: dict = {}
    q_bounds, k_bounds = bounds(layout.q_chunks), bounds(layout.k_chunks)
    for b in product(*(range(len(c)) for c in layout.batch_chunks)):
        has_rows = all(layout.batch_chunks[axis][i] for axis, i in enumerate(b))
        for h, heads in enumerate(layout.head_chunks):
            for i, (q0, q1) in enumerate(q_bounds):
                reach = reachable(inputs.mask, q0, q1, k_bounds, inputs.q_len,
                                  inputs.kv_len) if has_rows and heads else []
                index = (*b, h, i)
                source = _query_block(inputs, layout, call, names, blocks, index, (q0, q1),
                                      [(j, *k_bounds[j]) for j in reach])
                out_key, lse_key = (names["out"], *index, 0), (names["lse"], *index)
                outs[out_key] = Task(out_key, getitem, source, 0)
                if inputs.return_lse:
                    lses[lse_key] = Task(lse_key, getitem, source, 1)
    return blocks, outs, lses


def _query_block(inputs: AttentionInputs, layout: Layout, call: ChunkCall,
                 names: dict[str, str], blocks: dict, index: tuple[int, ...],
                 rows: tuple[int, int], key_blocks: list[tuple[int, int, int]]) -> Any:
    """Add the tasks of query block ``index`` (``(*batch, head, query)`` chunk indices,
    query ``rows`` ``(q0, q1)``) over ``key_blocks`` ``[(j, k0, k1), ...]``; return a
    reference to its ``(out, lse)``."""
    from dask.task_spec import List, Task, TaskRef

    def ref(array: Any, at: tuple[int, ...]) -> Any:
        return TaskRef((array.name, *block_index(array, at)))

    *b, h, _ = index
    q0, q1 = rows
    query = ref(layout.query, (*index, 0))
    need_lse = inputs.return_lse or len(key_blocks) > 1
    parts = []
    for j, k0, k1 in key_blocks:
        pair = (*index, j)  # block of a full-rank (*batch, H, Lq, Lk) array
        kv = (*b, h, j, 0)
        bias = None if layout.bias is None else ref(layout.bias, pair)
        # lengths have the batch shape, dense masks are full rank
        pieces = List(*(ref(a, tuple(b) if a.ndim == len(b) else pair)
                        for a in layout.mask_arrays))
        key = (names["block"], *pair)
        blocks[key] = Task(key, attend, call, q0, q1, k0, k1, need_lse, query,
                           ref(layout.key, kv), ref(layout.value, kv), bias, pieces)
        parts.append(TaskRef(key))
    if len(parts) == 1:
        return parts[0]
    if parts:
        key = (names["merge"], *index)
        blocks[key] = Task(key, merge_blocks, List(*parts))
    else:
        key = (names["zeros"], *index)
        blocks[key] = Task(key, empty, call, query)
    return TaskRef(key)


def _array(blocks: dict, deps: list, names: dict[str, str], part: str, tasks: dict,
           chunks: tuple, like: Any, dtype: Any) -> Any:
    """A Dask array over ``tasks`` (one per output block) on top of the block layer."""
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    base = HighLevelGraph.from_collections(names["block"], blocks, dependencies=deps)
    layers = {**base.layers, names[part]: MaterializedLayer(tasks)}
    dependencies = {**base.dependencies, names[part]: {names["block"]}}
    graph = HighLevelGraph(layers, dependencies)
    meta = meta_from_array(like, ndim=len(chunks), dtype=dtype)
    return da.Array(graph, names[part], chunks, meta=meta)
