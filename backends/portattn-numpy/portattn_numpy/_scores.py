"""Score tiles: their memory, computing them, masking them, turning them into weights
and their sums, and checking the fast way's sums.

Shared by the loops (``_tiles``, ``_diagonal``, ``_stacked``). Tiles are kept
keys by queries (OpenBLAS's AVX2 kernels run ``k @ q.T`` faster than ``q @ k.T`` for
these thin shapes), except those of the compiled blocks (``_compiled_blocks``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _jit
from ._scratch import take

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._changes import Shift
    from ._compiled_blocks import CompiledBlocks
    from ._loops import Loops
    from ._problem import Problem
    from ._units import Block

__all__ = ["ScoreTile", "accumulate_compiled", "add_bias", "finish_fast", "hide",
           "row_stride", "scores", "trustworthy"]

#: Smallest row sum (relative to the number of keys) the fast way trusts: above it
#: each row's largest term is a normal float with room to spare.
_TINY = {np.dtype(np.float32): 2.0**-100, np.dtype(np.float64): 2.0**-900}
_NO_LSE = {dt: np.empty(0, dt) for dt in _TINY}


#: Bytes between rows of a score tile that BLAS writes slowly: at a multiple of 2 KiB
#: its stores collide in the caches (rows one cache line further apart do not).
_COLLIDING = 2048
_CACHE_LINE = 64


def row_stride(rows: int, itemsize: int) -> int:
    """Entries from one row of a ``rows``-wide tile to the next: ``rows``, and one
    cache line more where that would be a multiple of 2 KiB."""
    collide = rows * itemsize % _COLLIDING == 0
    return rows + (_CACHE_LINE // itemsize if collide and rows else 0)


class ScoreTile:
    """Memory for one score tile, reused tile after tile: ``keys x rows`` views into
    one flat buffer (this thread's buffer ``name``, ``_scratch``), :func:`row_stride`
    entries from row to row. It holds a ``keys x rows`` tile (or ``rows x keys``) from
    the start, and grows when a larger one is asked for.
    """

    def __init__(self, name: str, keys: int, rows: int, dtype: Any) -> None:
        dt = np.dtype(dtype)
        self._name = name
        line = _CACHE_LINE // dt.itemsize  # room for the padding of either layout
        self._buffer = take(name, ((keys + line) * (rows + line),), dt)
        self._ones = np.ones(0, dt)  # for NumPy's row sums, grown when first needed

    def scores(self, keys: int, rows: int) -> tuple[Any, Any]:
        """``(span, view)``: a ``keys x rows`` view to write scores to, and the
        contiguous span holding it."""
        span, _ = self.span(keys, rows)
        return span, span.reshape(keys, -1)[:, :rows]

    def span(self, keys: int, rows: int) -> tuple[Any, int]:
        """``(span, stride)``: the contiguous memory of a ``keys x rows`` tile, and the
        entries from one of its rows to the next (``span(rows, keys)``: queries by
        keys)."""
        stride = row_stride(rows, self._buffer.itemsize)
        if keys * stride > self._buffer.size:
            self._buffer = take(self._name, (keys * stride,), self._buffer.dtype)
        return self._buffer[:keys * stride], stride

    def weights(self, loops: Loops, keys: int, rows: int, masks: list[Any],
                sums: Any) -> Any:
        """The scores in ``scores(keys, rows)`` turned into unnormalised weights in
        place: their exponential (``loops.exponential``), 0 where ``masks`` hide them
        (:func:`hide`); each query's (column's) sum is written to ``sums``. The view.

        A compiled exponential does all of it in one pass over the rows
        (``loops.exponential_rows``), the hidden scores set to ``-inf`` first. NumPy's
        takes a pass each: the exponential over the contiguous span holding the view
        (it iterates a strided 2-D operand through copies, at twice the cost) with the
        padding zeroed first, so that leftovers never overflow into the slow path it
        takes on infinities; then the mask (after the exponential, which slows down
        several-fold on ``-inf`` lanes); then the sums, as a product with ones (several
        times faster than ``sum(axis=0)``).
        """
        span, view = self.scores(keys, rows)
        if loops.exponential_rows is not None:
            hide(view, masks, -np.inf)
            loops.exponential_rows(span, row_stride(rows, span.itemsize), keys, rows, sums)
            return view
        padding = span.reshape(keys, -1)[:, rows:]
        if padding.size:
            padding[...] = 0
        loops.exponential(span)
        hide(view, masks, 0.0)
        if keys > self._ones.size:
            self._ones = np.ones(keys, view.dtype)
        np.matmul(self._ones[:keys], view, out=sums)
        return view


def scores(p: Problem, keys: Any, queries_t: Any, out: Any = None, whole: Any = None) -> Any:
    """``keys @ queries_t`` into ``out`` (stacked or not; a new array when None),
    softcapped when asked (over ``whole``, a contiguous array holding ``out``, when
    given: its padding holds leftovers, which no product reads)."""
    out = np.matmul(keys, queries_t, out=out)
    if p.softcap is not None:
        each = out if whole is None else whole
        np.tanh(each, out=each)
        np.multiply(each, p.softcap, out=each)
    return out


def accumulate_compiled(compiled: CompiledBlocks, on_tile: Callable[..., Any] | None,
                        tile: ScoreTile, alpha: float, q: Any, k: Any, v: Any, acc: Any,
                        sums: Any, blocks: list[Block], packed: tuple[Any, Any, Any], *,
                        first_writes: bool, unit: tuple[tuple[int, ...], int, int],
                        change: Shift | None = None) -> None:
    """``blocks`` the fast way, in one ``compiled`` call: the weights of keys ``k0:k1``
    for rows ``r0:r1`` of ``alpha * q`` (0 where the block's masks hide them) times the
    values, added to those rows of ``acc``, and their sums to ``sums`` (``first_writes``:
    the first block covers every row and writes them). ``packed``: the blocks as the
    compiled loops read them (``UnitBlocks.packed``); ``tile``: the memory of the
    scores, here queries by keys; ``unit``: ``(batch index, head, first row)``, for the
    ``on_tile`` hook (``Config.on_tile``), called first for every block, and for the
    entries of ``change``, a score change by distance (``_changes``) or None."""
    if on_tile is not None:
        b, h, q0 = unit
        for k0, k1, r0, r1, _ in blocks:
            on_tile(b, h, q0 + r0, q0 + r1, k0, k1)
    keys = max(k1 - k0 for k0, k1, *_ in blocks)
    span, stride = tile.span(max(r1 - r0 for _, _, r0, r1, _ in blocks), keys)
    spans, masks, hidden = packed
    shift, origin = None, 0
    if change is not None:
        _, h, q0 = unit
        shift, origin = change.forward[h], change.origin(q0)
    compiled.accumulate(alpha, q, k, v, acc, sums, span, stride, spans, masks, hidden,
                        first_writes=first_writes, shift=shift, origin=origin)


def finish_fast(compiled: CompiledBlocks | None, acc: Any, sums: Any, keys: int, out: Any,
                lse: Any) -> bool:
    """The fast way's last step: ``out = acc / sums`` and ``lse = log(sums)`` (unless
    None) if :func:`trustworthy` (with ``keys`` keys); False, writing nothing, if not.
    ``acc``: C-contiguous, its first columns those of ``out`` (more may follow).
    ``compiled``: the compiled blocks, whose last step does it in one call, or None."""
    if compiled is None:
        acc = acc[:, :out.shape[-1]]
        if not trustworthy(sums, acc, keys):
            return False
        np.divide(acc, sums[:, None], out=out)
        if lse is not None:
            np.log(sums, out=lse)
        return True
    return compiled.finish(acc, sums, _TINY[sums.dtype] * keys, out,
                           _NO_LSE[sums.dtype] if lse is None else lse)


def add_bias(tile: Any, bias: Any) -> None:
    """Add a (queries by keys) ``bias`` block to a (keys by queries) tile: compiled
    where Numba is installed (``_compiled_bias``: NumPy's transposed ``add`` is slow)."""
    compiled = _jit.load("_compiled_bias")
    if compiled is None:
        np.add(tile, bias.T, out=tile)
    else:
        compiled.add_transposed(tile, bias)


def hide(tile: Any, masks: list[Any], value: float) -> None:
    """Set the masked entries of a (keys by queries) tile to ``value``: ``masks`` holds
    ``(key offset, row offset, hidden)``, ``hidden`` queries by keys (``_blocks``)."""
    for k0, r0, hidden in masks:
        rows, keys = hidden.shape
        np.copyto(tile[k0:k0 + keys, r0:r0 + rows], value, where=hidden.T)


def trustworthy(sums: Any, acc: Any, keys: int, where: Any = True) -> bool:
    """Did the fast way stay in range: no overflow, no row lost to underflow? Only rows
    ``where`` allows are held to the smallest sum (the others attend nothing)."""
    # one NaN or inf anywhere makes a total non-finite (a total that overflows on its
    # own only costs a needless careful pass)
    return bool(np.min(sums, initial=np.inf, where=where) >= _TINY[sums.dtype] * keys
                and math.isfinite(sums.sum()) and math.isfinite(acc.sum()))
