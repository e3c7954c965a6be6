"""The lazy graph of one attention call.

For every query block ``(*batch, heads, query rows)`` the mask's block form on the
chunk grid tells which key blocks it sees at all (:mod:`portattn_dask._chunk_masks`);
each such pair is one task, a query block split over several key blocks gets one merge
task (split-KV; with sinks, every query block that sees a key gets it: the sinks join
there), and a block that sees no key gets one task making zeros. Hidden pairs are
never scheduled, so the graph holds at most ``query blocks x (key blocks + 3)`` tasks of
its own.
"""

from __future__ import annotations

from itertools import product
from operator import getitem
from typing import TYPE_CHECKING, Any

from ._alibi import aligned_parts
from ._block import BlockCall, ChunkCall, Part, attend, empty, merge_blocks
from ._chunk_masks import ChunkMasks, chunk_masks
from ._layout import Layout, align, block_index, bounds

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["blockwise_attention"]


def blockwise_attention(inputs: AttentionInputs) -> tuple[Any, Any]:
    """Lazy ``(out, lse)`` Dask arrays (``lse`` None unless asked)."""
    from dask.base import tokenize

    layout = align(inputs)
    plan = chunk_masks(inputs, layout)
    call = ChunkCall(inputs.scale, inputs.softcap, inputs.q_len, inputs.kv_len,
                     inputs.value_head_dim)
    arrays = (layout.query, layout.key, layout.value, layout.bias, *layout.dense,
              layout.alibi_slopes, layout.sinks)
    token = tokenize(*arrays, plan.read, None if plan.mask is None else plan.mask.structure(),
                     inputs.scale, inputs.softcap, inputs.return_lse, tuple(call.overrides))
    names = {part: f"attention-{part}-{token}"
             for part in ("block", "merge", "zeros", "out", "lse")}
    blocks, outs, lses = _tasks(inputs, layout, plan, call, names)
    deps = [a for a in arrays if a is not None]
    chunks = (*layout.batch_chunks, layout.head_chunks, layout.q_chunks)
    out = _array(blocks, deps, names, "out", outs, (*chunks, (inputs.value_head_dim,)),
                 layout.query, inputs.query.dtype)
    lse = None
    if inputs.return_lse:
        lse = _array(blocks, deps, names, "lse", lses, chunks, layout.query,
                     inputs.compute_dtype)
    return out, lse


def _tasks(inputs: AttentionInputs, layout: Layout, plan: ChunkMasks, call: ChunkCall,
           names: dict[str, str]) -> tuple[dict, dict, dict]:
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
                seen = plan.key_blocks(b, h, i) if has_rows and heads else []
                index = (*b, h, i)
                source = _query_block(inputs, layout, call, names, blocks, index, (q0, q1),
                                      [(j, *k_bounds[j], full) for j, full in seen], plan)
                out_key, lse_key = (names["out"], *index, 0), (names["lse"], *index)
                outs[out_key] = Task(out_key, getitem, source, 0)
                if inputs.return_lse:
                    lses[lse_key] = Task(lse_key, getitem, source, 1)
    return blocks, outs, lses


def _query_block(inputs: AttentionInputs, layout: Layout, call: ChunkCall,
                 names: dict[str, str], blocks: dict, index: tuple[int, ...],
                 rows: tuple[int, int], key_blocks: list[tuple[int, int, int, bool]],
                 plan: ChunkMasks) -> Any:
    """Add the tasks of query block ``index`` (``(*batch, head, query)`` chunk indices,
    query ``rows`` ``(q0, q1)``) over ``key_blocks`` ``[(j, k0, k1, full), ...]``; return
    a reference to its ``(out, lse)``."""
    from dask.task_spec import List, Task, TaskRef

    def ref(array: Any, at: tuple[int, ...]) -> Any:
        return None if array is None else TaskRef((array.name, *block_index(array, at)))

    *b, h, _ = index
    q0, q1 = rows
    query = ref(layout.query, (*index, 0))
    sinks = ref(layout.sinks, (*b, h))
    slopes = ref(layout.alibi_slopes, (*b, h))
    need_lse = inputs.return_lse or len(key_blocks) > 1 or sinks is not None
    results = []
    for j, k0, k1, full in key_blocks:
        pair = (*index, j)  # block of a full-rank (*batch, H, Lq, Lk) array
        kv = (*b, h, j, 0)
        joined, cuts = ("keys", ((q0, q1, k0, k1),)) if slopes is None else aligned_parts(
            q0, q1, k0, k1, inputs.q_len, inputs.kv_len)
        parts = tuple(Part(*cut, None if full else plan.recipe(tuple(b), h, *cut))
                      for cut in cuts)
        dense = [] if full else List(*(ref(a, pair) for a in layout.dense))
        key = (names["block"], *pair)
        blocks[key] = Task(key, attend, call, BlockCall(q0, k0, need_lse, parts, joined),
                           query, ref(layout.key, kv), ref(layout.value, kv),
                           ref(layout.bias, pair), slopes, dense)
        results.append(TaskRef(key))
    if len(results) == 1 and sinks is None:
        return results[0]
    if results:
        key = (names["merge"], *index)
        blocks[key] = Task(key, merge_blocks, List(*results), sinks)
    else:
        key = (names["zeros"], *index)
        blocks[key] = Task(key, empty, call, query, sinks)
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
