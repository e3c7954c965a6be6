"""The backward pass of the tiled kernel (FlashAttention-2), in pure Array API.

Nothing of the forward is kept but its output and log-sum-exp: each tile's
probabilities are recomputed as ``P = exp(s - lse)``, so memory stays O(L * block)
instead of the O(Lq * Lk) that recording every tile would keep. Per tile, with
``Delta = rowsum(dO * O) - dlse``::

    dV += P^T dO        dP = dO V^T        dS = P * (dP - Delta)
    dQ += dS K          dK += dS^T Q       dBias += dS

A score change's tables (:mod:`portattn.scores`) get ``dS`` reduced into their entries
tile by tile, by products with one-hot matrices rather than a scatter, summed in the
order the tiles are visited: the same sums on every run.

(``dlse`` is the gradient of the returned log-sum-exp: ``d lse / d s = P``.) With
dropout, ``Z`` the tile's kept pairs over ``1 - p`` (regenerated from the seed, see
:mod:`portattn.dropout`): ``dV += (P * Z)^T dO`` and ``dS = P * (dP * Z - Delta)``,
``Delta`` unchanged since ``rowsum(P * dP * Z) = rowsum(dO * O)``. A sink
logit ``z`` per head (in the lse, attending no value) gets ``-sum P_z * Delta`` with
``P_z = exp(z - lse)``. A softcap
multiplies ``dS`` by ``1 - tanh^2`` before it reaches Q and K. The tiles the forward
visited are visited again (the same block form); fully masked rows (lse ``-inf``) get
``P = 0`` and so gradient 0. Grouped-query heads are summed into their K/V head per
tile.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import array_api_extra as xpx

from .._lib import values_readable
from ._dropout import seed_word
from ._portable import (
    add_rows,
    cast,
    dropped,
    finite_or_zero,
    group_kv,
    group_queries,
    is_empty,
    kept,
    per_head_column,
    rows,
    scores,
    split_nonfinite,
    transposed,
    ungroup,
    ungroup_scores,
)
from ._tiled import block_sizes

if TYPE_CHECKING:
    from .._inputs import AttentionInputs

__all__ = ["Gradients", "flash_backward"]


class Gradients(NamedTuple):
    """What :func:`flash_backward` returns, each in its input's dtype and shape."""

    query: Any
    key: Any
    value: Any
    bias: Any
    """None unless asked for (``bias_grad``)."""
    sinks: Any
    """None without ``inputs.sinks``."""
    score_mod: Any = None
    """Without ``inputs.score_mod`` None; else a gradient per array of the change
    (:attr:`~portattn.scores.ScoreChange.arrays`), None for those that get none."""


def flash_backward(inputs: AttentionInputs, out: Any, lse: Any, dout: Any,
                   dlse: Any = None, *, bias_grad: bool = False,
                   into: tuple[Any, Any, Any] | None = None) -> Gradients:
    """The :class:`Gradients` of attention ``(out, lse)`` computed from ``inputs``.

    ``lse`` is the forward's log-sum-exp ``(..., Hq, Lq)``; ``dout`` and ``dlse`` (None
    for zero) are the gradients of the output and of the lse. The bias gradient is
    computed only with ``bias_grad``, the sinks' whenever the call has sinks. Half
    precision is accumulated in float32.

    ``into``: accumulators ``(dq, dk, dv)`` in the compute dtype, shaped like query,
    key and value, that the gradients are added to, tile by tile, in place where the
    library allows (a caller summing many calls, each over a slice of its buffers,
    then allocates no gradient of its own); the gradients returned are those sums, in
    the compute dtype.
    """
    xp = inputs.xp
    if is_empty(inputs):
        if into is not None:  # nothing to add
            return Gradients(*into, *_zero_grads(inputs, bias_grad, dlse)[3:])
        return _zero_grads(inputs, bias_grad, dlse)
    ct = inputs.compute_dtype
    hkv = inputs.num_kv_heads
    block_q, block_k = block_sizes(inputs)
    # Non-finite entries the mask hides (in keys, values or padded queries) must not
    # reach the gradients through 0 * NaN in a product: every product takes them
    # zeroed. A row that attends one has a NaN output and lse, hence NaN P and dS.
    k = _clean(xp, group_kv(xp, cast(xp, inputs.key, ct)), ct)
    v = _clean(xp, group_kv(xp, cast(xp, inputs.value, ct)), ct)
    query = _clean(xp, inputs.query, ct)
    lse = finite_or_zero(xp, cast(xp, lse, ct))
    # Written block by block in place (functionally where arrays are immutable), so
    # no list of blocks and its concatenation are ever alive at once.
    # Under torch.func.vmap (batched gradients) dout is batched: the accumulators take
    # their zeros from it so they are batched too (adding into plain ones in place fails).
    if into is None:
        batched = xp.zeros_like(dout[..., :1, :1, :1])
        dq, dk, dv = (_zeros(inputs, a) + batched
                      for a in (inputs.query, inputs.key, inputs.value))
    else:
        dq, dk, dv = into
    bias = _BiasGrad(inputs, block_q, block_k) if bias_grad else None
    tables = None if inputs.score_mod is None else _TableGrads(inputs)
    dsinks = None
    blocks = inputs.blocks(block_q, block_k)
    word = seed_word(inputs) if inputs.dropout_p else None
    for a in range(blocks.num_q_blocks):
        q0, q1 = blocks.q_range(a)
        q = group_queries(xp, cast(xp, rows(query, q0, q1), ct) * inputs.scale, hkv)
        do = cast(xp, rows(dout, q0, q1), ct)
        d = xp.sum(do * cast(xp, rows(out, q0, q1), ct), axis=-1, keepdims=True)
        if dlse is not None:
            d = d - cast(xp, dlse[..., q0:q1, None], ct)
        do, d = group_queries(xp, do, hkv), group_queries(xp, d, hkv)
        m = group_queries(xp, lse[..., q0:q1, None], hkv)
        if inputs.sinks is not None:  # d lse / d sink = its weight; d out / d sink = -w out
            sink = per_head_column(inputs, inputs.sinks, ct)
            part = -xp.sum(xp.exp(sink - m) * d, axis=(-2, -1))
            dsinks = part if dsinks is None else dsinks + part
        dq_block = None
        for b, full in blocks.kv_blocks(a):  # the tiles the forward visited
            k0, k1 = blocks.kv_range(b)
            tile = scores(inputs, q, rows(k, k0, k1), q0, q1, k0, k1, masked=not full)
            p, t = tile.weights(xp, m), tile.tanh
            keep = kept(inputs, word, q0, q1, k0, k1)
            dv_tile = xp.sum(xp.matmul(transposed(xp, dropped(inputs, p, keep)), do),
                             axis=-3)
            dp = dropped(inputs, xp.matmul(do, transposed(xp, rows(v, k0, k1))), keep)
            ds = p * (dp - d)
            if tables is not None:  # first: a score function passes on a new ds
                ds = tables.add(ds, tile.before, q0, q1, k0, k1)
            if bias is not None:
                bias.add(ds, q0, q1, k0, k1)
            if t is not None:
                ds = ds * (1 - t * t)
            dq_tile = xp.matmul(ds, rows(k, k0, k1))
            dk_tile = xp.sum(xp.matmul(transposed(xp, ds), q), axis=-3)
            dq_block = dq_tile if dq_block is None else dq_block + dq_tile
            dk = add_rows(xp, dk, k0, k1, cast(xp, dk_tile, dk.dtype))
            dv = add_rows(xp, dv, k0, k1, cast(xp, dv_tile, dv.dtype))
            # freed now, not when the next tile's replace them: one tile's set alive
            del tile, p, t, keep, dv_tile, dp, ds, dq_tile, dk_tile
        if dq_block is not None:  # else the mask leaves this query block no keys
            dq_block = ungroup(xp, dq_block) * inputs.scale
            dq = add_rows(xp, dq, q0, q1, cast(xp, dq_block, dq.dtype))
    if into is None:
        dq, dk, dv = (cast(xp, g, a.dtype) for g, a in zip(
            (dq, dk, dv), (inputs.query, inputs.key, inputs.value), strict=True))
    return Gradients(dq, dk, dv, None if bias is None else bias.result(),
                     None if dsinks is None else _per_head_grad(inputs, dsinks),
                     None if tables is None else tables.result())


def _clean(xp: Any, x: Any, ct: Any) -> Any:
    """``x`` with its non-finite entries zeroed; ``x`` itself when its values can be
    read and its sum is finite (then every entry is: an infinity or NaN would make
    the sum one), a check that allocates no array the size of ``x``."""
    if values_readable(x) and bool(xp.isfinite(xp.sum(x, dtype=ct))):
        return x
    return split_nonfinite(xp, x)[0]


def _per_head_grad(inputs: AttentionInputs, grouped: Any) -> Any:
    """``(*b, Hkv, G)`` summed over the batch axes a per-head input broadcasts along."""
    xp = inputs.xp
    total = xp.reshape(grouped, (*grouped.shape[:-2], inputs.num_heads))
    shape = tuple(inputs.sinks.shape)
    axes = tuple(i for i, n in enumerate(shape[:-1]) if n == 1 and total.shape[i] != 1)
    if axes:
        total = xp.sum(total, axis=axes, keepdims=True)
    return cast(xp, total, inputs.sinks.dtype)


def _zeros(inputs: AttentionInputs, like: Any) -> Any:
    """Zeros shaped like ``like``, in the compute dtype (half precision sums in float32)."""
    return inputs.xp.zeros(like.shape, dtype=inputs.compute_dtype, device=inputs.device_obj)


def _accumulate(blocks: dict[Any, Any], key: Any, tile: Any) -> None:
    blocks[key] = tile if key not in blocks else blocks[key] + tile


class _BiasGrad:
    """Accumulates ``dS`` tiles reduced to the bias's broadcast shape.

    The bias is full rank ``(*b|1, H|1, Lq|1, Lk|1)``; a size-1 axis sums over the
    tile, a size-1 row or column axis also over the tiles along it.
    """

    def __init__(self, inputs: AttentionInputs, block_q: int, block_k: int) -> None:
        self.inputs = inputs
        shape = tuple(inputs.bias.shape)
        self.axes = tuple(i for i, n in enumerate(shape[:-2]) if n == 1)
        self.rows_broadcast, self.cols_broadcast = shape[-2] == 1, shape[-1] == 1
        self.rows = _grid(1 if self.rows_broadcast else inputs.q_len, block_q)
        self.cols = _grid(1 if self.cols_broadcast else inputs.kv_len, block_k)
        self.tiles: dict[tuple[int, int], Any] = {}

    def add(self, ds: Any, q0: int, q1: int, k0: int, k1: int) -> None:
        xp = self.inputs.xp
        tile = ungroup(xp, ds)
        full = tuple(tile.shape)
        axes = tuple(i for i in self.axes if full[i] != 1)
        if self.rows_broadcast:
            axes += (len(full) - 2,)
        if self.cols_broadcast:
            axes += (len(full) - 1,)
        if axes:
            tile = xp.sum(tile, axis=axes, keepdims=True)
        key = (0 if self.rows_broadcast else q0, 0 if self.cols_broadcast else k0)
        _accumulate(self.tiles, key, tile)

    def result(self) -> Any:
        inputs, xp = self.inputs, self.inputs.xp
        if len(self.tiles) == len(self.rows) * len(self.cols) == 1:
            return cast(xp, self.tiles[0, 0], inputs.bias.dtype)
        shape = (*inputs.bias.shape[:-2], self.rows[-1][1], self.cols[-1][1])
        total = xp.zeros(shape, dtype=inputs.compute_dtype, device=inputs.device_obj)
        if self.tiles:  # batched under vmap, as the tiles are, so they add in place
            total = total + xp.sum(xp.zeros_like(next(iter(self.tiles.values()))))
        for (r0, c0), tile in self.tiles.items():  # tiles the mask hides stay 0
            r1, c1 = r0 + tile.shape[-2], c0 + tile.shape[-1]
            total = xpx.at(total)[..., r0:r1, c0:c1].add(tile)
        return cast(xp, total, inputs.bias.dtype)


class _TableGrads:
    """Sums a score change's table gradients over the tiles, in the compute dtype."""

    def __init__(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        self.sums: list[Any] | None = None

    def add(self, ds: Any, before: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
        """Adds the arrays' gradients of one tile; returns the gradient of the scores
        before the change (``ds`` itself for a change that adds; ``before``: the scores
        a score function mapped, in grouped layout)."""
        inputs, xp = self.inputs, self.inputs.xp
        change, ct = inputs.score_mod, inputs.compute_dtype
        if change.additive:
            parts = change.table_gradients(xp, ungroup(xp, ds), q0, q1, k0, k1,
                                           inputs.q_len, inputs.kv_len, ct)
        else:
            full = ungroup_scores(inputs, before)
            ds_in, parts = change.score_gradients(
                xp, full, xp.broadcast_to(ungroup(xp, ds), tuple(full.shape)), q0, q1, k0,
                k1, ct)
            ds = xp.reshape(ds_in, (*full.shape[:-3], *ds.shape[-4:]))
        self._sum(parts)
        return ds

    def _sum(self, parts: tuple[Any, ...]) -> None:
        if self.sums is None:
            self.sums = list(parts)
        else:
            self.sums = [s if p is None else s + p for s, p in zip(self.sums, parts,
                                                                    strict=True)]

    def result(self) -> tuple[Any, ...]:
        change = self.inputs.score_mod
        if self.sums is None:  # the mask hides every pair
            return _zero_tables(self.inputs)
        return tuple(None if s is None else cast(self.inputs.xp, s, a.dtype)
                     for s, a in zip(self.sums, change.arrays, strict=True))


def _zero_tables(inputs: AttentionInputs) -> tuple[Any, ...] | None:
    change = inputs.score_mod
    if change is None:
        return None
    return tuple(inputs.xp.zeros_like(a) if t else None
                 for a, t in zip(change.arrays, change.trainable, strict=True))


def _grid(length: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(length, s + block)) for s in range(0, length, block)]


def _zero_grads(inputs: AttentionInputs, bias_grad: bool, dlse: Any) -> Gradients:
    """No key, query or row: every gradient is 0 but the sinks', where each row's lse
    is its sink (no key) and so passes its gradient on whole."""
    xp = inputs.xp
    grads = tuple(xp.zeros_like(a) for a in (inputs.query, inputs.key, inputs.value))
    dbias = xp.zeros_like(inputs.bias) if bias_grad else None
    dsinks = None
    if inputs.sinks is not None:
        dsinks = xp.zeros_like(inputs.sinks)
        if dlse is not None and math.prod(dlse.shape):
            rows = xp.sum(cast(xp, dlse, inputs.compute_dtype), axis=-1)
            dsinks = _per_head_grad(inputs, xp.reshape(rows, (*rows.shape[:-1],
                                                              inputs.num_kv_heads, -1)))
    return Gradients(*grads, dbias, dsinks, _zero_tables(inputs))

