"""Cutting one call into work units: tile sizes, mask structure, skipped tiles.

A unit is one query tile of one head with the key range it can reach; under a
causal-shaped mask, a run of query squares computed along the diagonal (``_diagonal``);
for small heads, a run of whole heads (``_stacked``).
The structured mask decides that range before any arithmetic: causal and
sliding-window masks through ``key_range``, key and query lengths by reading the
(small) length arrays. Units with nothing to attend are never created; their rows keep
output 0 and lse ``-inf``.
"""

from __future__ import annotations

import functools
import math
import operator
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _diagonal, _stacked
from ._problem import Problem, Unit

if TYPE_CHECKING:
    from collections.abc import Iterable

    from portattn import AttentionInputs

    from ._diagonal import Diagonal

__all__ = ["block_sizes", "build", "tile_bytes", "units_for", "useful_threads"]

#: Try the unshifted exponential first (see ``_engine``); tests turn it off to check
#: the careful way alone.
TRY_FAST = True

_POSITIONAL = frozenset({"causal", "sliding_window"})
MIN_BLOCK_Q = 16
MAX_BLOCK_Q = 512
MAX_BLOCK_K = 1024
MIN_UNITS_PER_THREAD = 4
#: Fewest diagonal squares in a unit (see ``_diagonal_rows``).
MIN_SQUARES = 4
#: Score entries a thread must get before handing it work pays: below this (about
#: half a millisecond of work) the thread's start and the GIL cost more than it saves.
MIN_SCORES_PER_THREAD = 1 << 18


@functools.cache
def tile_bytes() -> int:
    """Bytes of one score tile: half the per-core L2 cache (1 MiB when unknown)."""
    try:
        l2 = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (AttributeError, ValueError, OSError):
        l2 = 0
    return min(4 << 20, max(256 << 10, l2 // 2)) if l2 > 0 else 1 << 20


def block_sizes(q_len: int, kv_len: int, itemsize: int, *, heads: int = 1,
                threads: int = 1) -> tuple[int, int]:
    """Query and key block lengths whose score tile fills :func:`tile_bytes`.

    Keys come in blocks of at most :data:`MAX_BLOCK_K` (longer blocks measured no
    faster, shorter ones add per-block overhead); queries fill the rest, and shrink when
    there would be too few units to keep every thread busy.
    """
    elements = tile_bytes() // itemsize
    block_k = min(max(kv_len, 1), MAX_BLOCK_K)
    block_q = min(MAX_BLOCK_Q, max(MIN_BLOCK_Q, elements // block_k))
    want_tiles = math.ceil(MIN_UNITS_PER_THREAD * threads / max(heads, 1))
    if want_tiles > 1:
        block_q = min(block_q, max(MIN_BLOCK_Q, math.ceil(q_len / want_tiles)))
    return max(1, min(block_q, q_len)), block_k


def useful_threads(units: list[Unit], threads: int) -> int:
    """How many of ``threads`` the units can keep busy."""
    scores = sum((q1 - q0) * (hi - lo) for _, _, q0, q1, lo, hi in units)
    return max(1, min(threads, scores // MIN_SCORES_PER_THREAD))


def _diagonal_rows(q_len: int, diagonal: Diagonal, *, heads: int = 1, threads: int = 1) -> int:
    """Rows per unit along the diagonal: as many squares as one tile holds (they are
    computed in one stacked product), fewer when the threads need more units.

    These units are coarse and unequal, so threads get twice as many of them as of
    tiles, to finish together; but each keeps :data:`MIN_SQUARES` squares, or its few
    fixed calls would outweigh its work.
    """
    squares = diagonal.squares
    want_units = math.ceil(2 * MIN_UNITS_PER_THREAD * threads / max(heads, 1))
    if want_units > 1:
        squares = min(squares, max(MIN_SQUARES, q_len // diagonal.size // want_units))
    return squares * diagonal.size


def _row_ranges(rows: int, step: int, square: int = 1) -> list[tuple[int, int]]:
    """``rows`` cut into ranges of ``step`` rows, each starting on a whole ``square``;
    rows past the last whole square join the last range."""
    whole = rows // square * square
    ranges = [(q0, min(whole, q0 + step)) for q0 in range(0, whole, step)]
    if whole < rows:
        ranges[-1:] = [(ranges[-1][0] if ranges else 0, rows)]
    return ranges


def units_for(p: Problem, b: tuple[int, ...], heads: Iterable[int],
              row_ranges: Iterable[tuple[int, int]]) -> list[Unit]:
    """Units of ``heads`` of batch element ``b`` over ``row_ranges``, each with the keys
    its rows can reach; rows past the query length and keys past the key length are
    left out, and so are units with nothing to attend."""
    rows = p.q_len if p.query_len is None else int(p.query_len[b])
    keys = p.kv_len if p.key_len is None else int(p.key_len[b])
    heads = list(heads)
    units: list[Unit] = []
    for q0, q1 in row_ranges:
        q1 = min(q1, rows)
        if q1 <= q0:
            continue
        lo, hi = (0, p.kv_len) if p.positional is None else p.positional.key_range(
            q0, q1, p.q_len, p.kv_len)
        if min(hi, keys) > lo:
            units += [(b, h, q0, q1, lo, min(hi, keys)) for h in heads]
    return units


def _whole_mask(inputs: AttentionInputs) -> Any:
    """The mask over the whole problem, full rank (``(*batch|1, H|1, Lq|1, Lk|1)``)."""
    if inputs.mask is None:
        return None
    lq, lk = inputs.q_len, inputs.kv_len
    allowed = inputs.mask.tile(np, 0, lq, 0, lk, lq, lk)
    if allowed is None:  # every part covers everything
        return None
    allowed = np.asarray(allowed)
    rank = len(inputs.batch_shape) + 3
    return allowed.reshape((1,) * (rank - allowed.ndim) + allowed.shape)


def _blas_ready(a: Any) -> Any:
    """``a`` itself when BLAS can read its matrices in place, else a C-ordered copy."""
    a = np.asarray(a)
    size = a.itemsize
    rows_ok = a.ndim < 2 or (a.strides[-2] % size == 0 and a.strides[-2] >= a.shape[-1] * size)
    if a.strides[-1] != size or not rows_ok:
        a = np.ascontiguousarray(a)
    return a


def _lengths(parts: list[Any], kind: str) -> Any:
    """Per-batch valid lengths, the smallest over every part of that kind."""
    arrays = [np.asarray(p.lengths) for p in parts if p.kind == kind]
    return functools.reduce(np.minimum, arrays) if arrays else None


def build(inputs: AttentionInputs, threads: int = 1) -> tuple[Problem, list[Unit]]:
    """The problem the workers share and the units, costliest first."""
    query = np.asarray(inputs.query)  # only ever copied, tile by tile
    key, value = _blas_ready(inputs.key), _blas_ready(inputs.value)
    lq, lk, hq = inputs.q_len, inputs.kv_len, inputs.num_heads
    parts = list(inputs.mask.parts) if inputs.mask is not None else []
    positional_parts = [p for p in parts if p.kind in _POSITIONAL]
    positional = functools.reduce(operator.and_, positional_parts) if positional_parts else None
    heads = math.prod(inputs.batch_shape) * hq
    block_q, block_k = block_sizes(lq, lk, query.itemsize, heads=heads, threads=threads)
    key_len = _lengths(parts, "key_lengths")
    query_len = _lengths(parts, "query_lengths")
    dense = tuple(np.asarray(p.allowed) for p in parts if p.kind == "dense")
    tile_elements = tile_bytes() // query.itemsize
    skips = positional is not None or key_len is not None or query_len is not None
    # (no query heads at all: nothing to stack, and the group size is 0)
    stack = 0 if not hq else _stacked.heads_per_unit(
        lq, lk, inputs.group_size, hq // inputs.group_size, tile_elements, tiles_skip=skips)
    diagonal = None
    if not stack and inputs.bias is None and not dense and key_len is None and query_len is None:
        diagonal = _diagonal.find(positional, lq, lk, query.dtype, tile_elements)
    lead = (*inputs.batch_shape, hq)
    base2 = inputs.bias is None  # a bias would need its own pass to change base
    to_base = math.log2(math.e) if base2 else 1.0
    problem = Problem(
        query=query, key=key, value=value,
        out=np.zeros((*lead, lq, inputs.value_head_dim), query.dtype),
        lse=np.full((*lead, lq), -np.inf, query.dtype) if inputs.return_lse else None,
        factor=inputs.scale * (1.0 / inputs.softcap if inputs.softcap else to_base),
        softcap=None if inputs.softcap is None else inputs.softcap * to_base,
        base2=base2,
        bias=None if inputs.bias is None else np.asarray(inputs.bias),
        positional=positional, dense=dense,
        q_len=lq, kv_len=lk, group=inputs.group_size, block_q=block_q, block_k=block_k,
        fast=TRY_FAST, query_len=query_len, key_len=key_len, diagonal=diagonal, stack=stack,
        allowed=_whole_mask(inputs) if stack else None,
    )
    if diagonal is not None:
        step = _diagonal_rows(lq, diagonal, heads=heads, threads=threads)
        row_ranges = _row_ranges(lq, step, diagonal.size)
    else:
        row_ranges = _row_ranges(lq, block_q)
    units: list[Unit] = []
    for b in np.ndindex(*inputs.batch_shape):
        if stack:
            units += [(b, h, 0, lq, 0, lk) for h in range(0, hq, stack * inputs.group_size)]
        else:
            units += units_for(problem, b, range(hq), row_ranges)
    if skips:
        units.sort(key=lambda u: (u[3] - u[2]) * (u[5] - u[4]), reverse=True)
    return problem, units
