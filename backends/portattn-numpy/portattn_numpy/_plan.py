"""Planning one call, in one place, before any loop runs: NumPy views of the arrays,
the mask's block form, tile sizes, the loops that compute it (``_loops``), the strategy
(``_strategy``) and its units, each with the blocks it computes, costliest first.

The careful way has a plan of its own (:func:`careful`): the units the fast way could
not trust, cut again into tiles.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ._blocks import tile_units
from ._changes import distance_entries, entries_lead, shift_of
from ._exponential import BASE_2, chosen
from ._loops import loops_for
from ._memo import CallPlans
from ._problem import Problem
from ._strategy import choose
from ._units import Plan, work

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

    from ._config import Config
    from ._units import Unit

__all__ = ["block_sizes", "build", "careful", "useful_threads"]


def build(inputs: AttentionInputs, config: Config, tile_bytes: int, threads: int = 1) -> Plan:
    """The call planned with ``config`` and score tiles of ``tile_bytes``, for
    ``threads`` threads."""
    query = np.asarray(inputs.query)  # only ever copied, tile by tile
    key, value = _blas_ready(inputs.key), _blas_ready(inputs.value)
    lq, lk, hq = inputs.q_len, inputs.kv_len, inputs.num_heads
    heads = math.prod(inputs.batch_shape) * hq
    tile_elements = tile_bytes // query.itemsize
    block_q, block_k = block_sizes(lq, lk, tile_elements, config, heads=heads,
                                   threads=threads)
    change = inputs.score_mod if lq and lk else None  # no pair: nothing to change
    per_distance = None if change is None else distance_entries(change, lq, lk)
    lead, banded = (), False
    if change is not None and per_distance is None:
        # Its entries come for every batch element and head at once, and are made once
        # for every unit that reads them: the whole call's where they take no more
        # memory than the call's own arrays, else a query tile's at a time (``_bands``),
        # the tiles cut to take no more.
        room = _own_entries(query, key, value, inputs.value_head_dim)
        lead = entries_lead(change, lq, lk, query.ndim)
        per_row = math.prod(lead) * lk
        banded = per_row * lq > room
        if banded:
            block_q = min(block_q, max(config.min_block_q, room // per_row))
    lead = (*inputs.batch_shape, hq)
    mask = inputs.mask
    # masks of equal content key are the same on every call: so are their plans
    content = None if mask is None else mask.content_key()
    shared = None if mask is not None and content is None else (
        config, content, lq, lk, block_k)
    # a bias keeps the scores in base e: changing its base would cost a pass; so does
    # a score change's entries made for a range of queries and keys (those by distance
    # are converted once, in a vector per head)
    exponential = chosen(config.exponential, query.dtype, bias=inputs.bias is not None or (
        change is not None and per_distance is None))
    base2 = exponential in BASE_2
    to_base = math.log2(math.e) if base2 else 1.0
    problem = Problem(
        query=query, key=key, value=value,
        out=np.zeros((*lead, lq, inputs.value_head_dim), query.dtype),
        lse=np.full((*lead, lq), -np.inf, query.dtype) if inputs.return_lse else None,
        factor=inputs.scale * (1.0 / inputs.softcap if inputs.softcap else to_base),
        softcap=None if inputs.softcap is None else inputs.softcap * to_base,
        base2=base2, query_ready=_rows_ready(query),
        bias=None if inputs.bias is None else np.asarray(inputs.bias),
        mask=mask, blocks=None if mask is None else inputs.blocks(*config.mask_grid),
        q_len=lq, kv_len=lk, group=inputs.group_size, block_q=block_q, block_k=block_k,
        tile_elements=tile_elements,
        change=None if change is None else shift_of(
            change, per_distance, lq, lk, query.ndim, query.dtype, base_e=not base2,
            lead=lead, banded=banded, threads=threads),
    )
    loops = loops_for(config, exponential, query, value, inputs.softcap)
    strategy = choose(problem, config, loops, threads)
    plans = CallPlans(shared)
    units = [u for b in np.ndindex(*inputs.batch_shape)
             for u in strategy.units(problem, config, plans, b)]
    if problem.blocks is not None:  # units of unequal cost: the costliest first
        units.sort(key=lambda u: (u.q1 - u.q0) * (u.hi - u.lo), reverse=True)
    return Plan(problem, loops, strategy, units, False, config, plans)


def careful(plan: Plan, untrusted: list[Unit]) -> Plan:
    """The plan that redoes ``untrusted`` units of ``plan`` (of any strategy) the careful
    way: their heads and rows in query tiles, each against the keys it reaches."""
    p = plan.problem
    units = []
    for unit in untrusted:
        b, h, q0, q1 = unit[:4]
        tiles = [(t0, min(q1, t0 + p.block_q)) for t0 in range(q0, q1, p.block_q)]
        units += tile_units(p, plan.plans, b, range(h, h + unit.heads), tiles)
    return dataclasses.replace(plan, units=units, careful=True)


def block_sizes(q_len: int, kv_len: int, elements: int, config: Config, *, heads: int = 1,
                threads: int = 1) -> tuple[int, int]:
    """Query and key block lengths whose score tile holds ``elements`` entries.

    Queries come in tiles of ``preferred_block_q`` rows, keys in blocks that fill the
    rest of the tile, at most ``max_block_k``; behind a short key range queries fill
    the tile, up to ``max_block_q``. Query tiles shrink when there would be too few
    units to keep every thread busy.
    """
    want_tiles = math.ceil(config.min_units_per_thread * threads / max(heads, 1))

    def rows(wanted: int) -> int:
        if want_tiles > 1:
            wanted = min(wanted, max(config.min_block_q, math.ceil(q_len / want_tiles)))
        return max(1, min(wanted, q_len))

    block_k = min(max(kv_len, 1), config.max_block_k,
                  max(1, elements // rows(config.preferred_block_q)))
    return rows(min(config.max_block_q, max(config.min_block_q, elements // block_k))), block_k


def useful_threads(plan: Plan, threads: int) -> int:
    """How many of ``threads`` the plan's units can keep busy."""
    p = plan.problem
    width = p.query.shape[-1] + p.value.shape[-1]
    total = sum(work(u.heads, u.q1 - u.q0, u.hi - u.lo, width) for u in plan.units)
    return max(1, min(threads, total // plan.config.min_scores_per_thread))


def _own_entries(query: Any, key: Any, value: Any, value_head_dim: int) -> int:
    """Entries of the call's own arrays: the query, key, value and output."""
    return query.size + key.size + value.size + query.size // max(query.shape[-1], 1) * (
        value_head_dim)


def _rows_ready(a: Any) -> bool:
    """Can BLAS read the matrices of ``a`` in place (rows contiguous, one stride)?"""
    size = a.itemsize
    rows_ok = a.ndim < 2 or (a.strides[-2] % size == 0 and a.strides[-2] >= a.shape[-1] * size)
    return a.strides[-1] == size and rows_ok and a.flags.aligned


def _blas_ready(a: Any) -> Any:
    """``a`` itself when BLAS can read its matrices in place, else a C-ordered copy."""
    a = np.asarray(a)
    return a if _rows_ready(a) else np.ascontiguousarray(a)
