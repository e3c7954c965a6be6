"""Array API building blocks shared by the portable kernels.

Grouped-query attention never repeats K/V: queries are viewed as
``(*batch, Hkv, G, L, D)`` and keys/values as ``(*batch, Hkv, 1, L, D)``, so one
matmul broadcasts each K/V head over its group of G query heads.

No infinity is made here that the result does not hold: a hidden score is the lowest
finite value of its dtype (its weight is 0, see :meth:`Scores.weights`), so with
``jax.debug_infs`` only the inputs' infinities and the ``-inf`` lse of rows that
attend nothing show.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import array_api_extra as xpx
from array_api_compat import device as array_device

from .._lib import values_readable
from ..kernel import ANY, Kernel
from ..masks import KINDS, slice_tile
from . import _dropout as dropout

if TYPE_CHECKING:
    from .._inputs import AttentionInputs


class PortableKernel(Kernel):
    """What both portable kernels support: every library, device, dtype and mask."""

    namespaces = ANY
    devices = ANY
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})
    masks = frozenset(KINDS)
    bias = softcap = alibi = score_mod = score_functions = sinks = gqa = True
    value_head_dim = empty = True
    returns_lse = grad = dropout = dropout_seed = True


def cast(xp: Any, x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype``, itself when it already is (``astype`` copies; with
    ``copy=False`` torch makes an alias, which torch.func.vmap cannot batch)."""
    return x if x.dtype == dtype else xp.astype(x, dtype)


def rows(x: Any, start: int, stop: int) -> Any:
    """Positions ``start:stop`` of ``x`` (axis -2); ``x`` itself when that is all of
    them (torch makes a whole-axis slice an alias, which its legacy batching used by
    ``gradcheck(check_batched_grad=True)`` cannot batch)."""
    if start == 0 and stop >= x.shape[-2]:
        return x
    return x[..., start:stop, :]


def transposed(xp: Any, x: Any) -> Any:
    """``x`` with its last two axes swapped (``permute_dims``: torch's legacy batching
    has a rule for it and none for the ``swapaxes`` that ``matrix_transpose`` is)."""
    n = x.ndim
    return xp.permute_dims(x, (*range(n - 2), n - 1, n - 2))


def add_rows(xp: Any, acc: Any, start: int, stop: int, part: Any) -> Any:
    """``acc`` with ``part`` added to its positions ``start:stop`` (axis -2), in place
    where the library allows."""
    if start == 0 and stop >= acc.shape[-2]:
        acc += part  # in place on mutable arrays; a new array on JAX
        return acc
    return xpx.at(acc)[..., start:stop, :].add(part)


def with_rows(xp: Any, whole: Any, rows: list[int], new: Any) -> Any:
    """``whole`` with ``new[i]`` as its row ``rows[i]`` (axis 0), made by a gather: no
    write through an index array, which some libraries lack (array-api-strict) and
    others cannot take on arrays they hold immutable (JAX)."""
    n = whole.shape[0]
    where = list(range(n))
    for i, row in enumerate(rows):
        where[row] = n + i
    index = xp.asarray(where, dtype=xp.int32, device=array_device(whole))
    return xp.take(xp.concat([whole, new], axis=0), index, axis=0)


def group_queries(xp: Any, x: Any, num_kv_heads: int) -> Any:
    """``(*b, Hq, L, D) -> (*b, Hkv, G, L, D)``."""
    *batch, hq, length, dim = x.shape
    return xp.reshape(x, (*batch, num_kv_heads, hq // num_kv_heads, length, dim))


def group_kv(xp: Any, x: Any) -> Any:
    """``(*b, Hkv, L, D) -> (*b, Hkv, 1, L, D)``."""
    return xp.expand_dims(x, axis=-3)


def ungroup(xp: Any, x: Any, trailing: int = 2) -> Any:
    """``(*b, Hkv, G, *rest) -> (*b, Hq, *rest)`` where ``rest`` has ``trailing`` dims."""
    shape = tuple(x.shape)
    axis = len(shape) - trailing - 2
    return xp.reshape(x, (*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2:]))


def group_tile(xp: Any, tile: Any, num_kv_heads: int) -> Any:
    """A mask or bias tile of shape ``(tq, tk)`` or ``(*b, H, tq, tk)`` in grouped layout."""
    if tile.ndim == 2:
        return tile
    *batch, heads, tq, tk = tile.shape
    if heads == 1:
        return xp.reshape(tile, (*batch, 1, 1, tq, tk))
    return xp.reshape(tile, (*batch, num_kv_heads, heads // num_kv_heads, tq, tk))


class Scores(NamedTuple):
    """One tile's scores: ``s`` with hidden entries at the dtype's lowest finite value,
    ``allowed`` the tile's mask in grouped layout (None: every pair allowed), ``tanh``
    of the capped scores for the softcap's derivative (None without one), ``before``
    the scores a score function mapped, for its derivative (None without one)."""

    s: Any
    allowed: Any = None
    tanh: Any = None
    before: Any = None

    def weights(self, xp: Any, m: Any) -> Any:
        """``exp(s - m)`` for a finite row maximum ``m``, 0 where the mask hides a pair.

        Hidden pairs are exponentiated at 0 and then zeroed: exp of a far negative
        number (``-inf`` included) underflows, which CPUs compute several times slower,
        and a score the mask allows may be the lowest value too (a bias of it)."""
        if self.allowed is None:
            return xp.exp(self.s - m)
        p = xp.exp(xp.where(self.allowed, self.s - m, 0.0))
        return xp.where(self.allowed, p, 0.0)

    def visible(self, xp: Any) -> Any:
        """Pairs the scores let through: allowed, and not ``-inf`` (a bias may hide)."""
        shown = xp.logical_not(is_minus_inf(xp, self.s))
        return shown if self.allowed is None else self.allowed & shown


def scores(inputs: AttentionInputs, q: Any, k: Any, q0: int, q1: int, k0: int, k1: int,
           *, masked: bool = True) -> Scores:
    """Scaled, soft-capped, biased and masked :class:`Scores` of one tile (grouped
    layout); ``masked=False`` for a tile the block form says is full. ``q`` and ``k``
    are grouped, in the compute dtype, and ``q`` is already multiplied by the scale
    (cheaper than scaling the scores)."""
    xp = inputs.xp
    s = xp.matmul(q, transposed(xp, k))
    t = None
    if inputs.softcap is not None:
        t = xp.tanh(s / inputs.softcap)
        s = t * inputs.softcap
    if inputs.bias is not None:
        b = slice_tile(inputs.bias, q0, q1, k0, k1)
        s = s + group_tile(xp, cast(xp, b, s.dtype), inputs.num_kv_heads)
    if inputs.alibi_slopes is not None:
        s = s + alibi_tile(inputs, q0, q1, k0, k1, s.dtype)
    before = None
    if inputs.score_mod is not None:
        if inputs.score_mod.additive:
            s = s + score_mod_tile(inputs, q0, q1, k0, k1, s)
        else:
            before, s = s, mapped_tile(inputs, q0, q1, k0, k1, s)
    mask = inputs.mask
    if mask is None or not masked:
        return Scores(s, None, t, before)
    allowed = group_tile(xp, mask.tile(xp, q0, q1, k0, k1, inputs.q_len, inputs.kv_len,
                                       inputs.device_obj), inputs.num_kv_heads)
    # the scores' rank: JAX's numpy_rank_promotion("raise") refuses to broadcast up to it
    allowed = xp.reshape(allowed, (1,) * (s.ndim - allowed.ndim) + tuple(allowed.shape))
    return Scores(xp.where(allowed, s, lowest(xp, s.dtype)), allowed, t, before)


def scores_of_clean(inputs: AttentionInputs, q: Any, bad_q: Any, k: Any, bad_k: Any,
                    q0: int, q1: int, k0: int, k1: int, masked: bool = True) -> Scores:
    """:func:`scores` of queries and keys split by :func:`split_nonfinite`, with NaN put
    back where a row that held a non-finite entry meets such a key unmasked: the same
    scores, but autograd's ``dS @ K`` and ``dS^T @ Q`` never see ``0 * NaN`` from a
    hidden key or a padded query."""
    tile = scores(inputs, q, k, q0, q1, k0, k1, masked=masked)
    if bad_q is None and bad_k is None:
        return tile
    xp, s = inputs.xp, tile.s
    bad = xp.zeros((), dtype=s.dtype, device=inputs.device_obj)
    bad = bad + (0 if bad_q is None else bad_q) + (
        0 if bad_k is None else transposed(xp, bad_k))
    nan = xp.asarray(math.nan, dtype=s.dtype, device=inputs.device_obj)
    return tile._replace(s=xp.where((bad > 0) & tile.visible(xp), nan, s))


def kept(inputs: AttentionInputs, word: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
    """Dropout's kept pairs of one tile in grouped layout, or None without dropout
    (``word``: :func:`portattn.dropout.seed_word`, None without dropout)."""
    if word is None:
        return None
    return group_tile(inputs.xp, dropout.tile(inputs, word, q0, q1, k0, k1),
                      inputs.num_kv_heads)


def dropped(inputs: AttentionInputs, x: Any, keep: Any) -> Any:
    """``x`` with dropout applied: 0 where dropped, divided by ``1 - p`` where kept."""
    if keep is None:
        return x
    return inputs.xp.where(keep, x * (1.0 / (1.0 - inputs.dropout_p)), 0.0)


def lowest(xp: Any, dtype: Any) -> float:
    """The lowest finite value of ``dtype``: a hidden score (``exp`` of it less any
    row maximum is 0, and it is no infinity)."""
    return float(xp.finfo(dtype).min)


def is_minus_inf(xp: Any, x: Any) -> Any:
    """``x == -inf``, without an infinite constant to compare with."""
    return xp.isinf(x) & (x < 0)


def alibi_tile(inputs: AttentionInputs, q0: int, q1: int, k0: int, k1: int,
               dtype: Any) -> Any:
    """ALiBi's ``-slope * |i + Lk - Lq - j|`` over one tile, in grouped layout."""
    xp, dev = inputs.xp, inputs.device_obj
    rows = xp.arange(q0 + inputs.kv_len - inputs.q_len, q1 + inputs.kv_len - inputs.q_len,
                     device=dev)
    distance = xp.abs(rows[:, None] - xp.arange(k0, k1, device=dev)[None, :])
    slopes = cast(xp, inputs.alibi_slopes, dtype)[..., None, None]
    distance = xp.reshape(distance, (1,) * (len(slopes.shape) - 2) + tuple(distance.shape))
    return group_tile(xp, -slopes * cast(xp, distance, dtype), inputs.num_kv_heads)


def score_mod_tile(inputs: AttentionInputs, q0: int, q1: int, k0: int, k1: int,
                   s: Any) -> Any:
    """The score change's entries over one tile, in grouped layout at the rank and
    dtype of the scores ``s``."""
    xp = inputs.xp
    rank = len(inputs.batch_shape) + 3
    entries = inputs.score_mod.entries(xp, q0, q1, k0, k1, inputs.q_len, inputs.kv_len, rank)
    grouped = group_tile(xp, cast(xp, entries, s.dtype), inputs.num_kv_heads)
    return xp.reshape(grouped, (1,) * (s.ndim - grouped.ndim) + tuple(grouped.shape))


def mapped_tile(inputs: AttentionInputs, q0: int, q1: int, k0: int, k1: int, s: Any) -> Any:
    """The scores ``s`` of one tile (grouped layout) mapped by a score function."""
    xp = inputs.xp
    out = inputs.score_mod.apply(xp, ungroup_scores(inputs, s), q0, q1, k0, k1)
    return xp.reshape(out, tuple(s.shape))


def ungroup_scores(inputs: AttentionInputs, s: Any) -> Any:
    """A tile ``s`` in grouped layout as ``(*batch, Hq, tq, tk)``, the batch axes
    broadcast out (a score function sees every batch element and head)."""
    xp = inputs.xp
    hkv, group, tq, tk = s.shape[-4:]
    full = xp.broadcast_to(s, (*inputs.batch_shape, hkv, group, tq, tk))
    return xp.reshape(full, (*inputs.batch_shape, hkv * group, tq, tk))


def per_head_column(inputs: AttentionInputs, values: Any, dtype: Any) -> Any:
    """A value per query head, ``(*b | 1, Hq)``, as a grouped column
    ``(*b | 1, Hkv, G, 1, 1)`` that broadcasts against a tile's rows."""
    xp = inputs.xp
    return group_tile(xp, cast(xp, values, dtype)[..., None, None], inputs.num_kv_heads)


def add_sinks(inputs: AttentionInputs, acc: Any, m: Any, denom: Any) -> tuple[Any, Any, Any]:
    """``(acc, m, denom)`` of an online softmax with each head's sink logit joined to
    the denominator (it attends no value); ``m`` must be finite (a safe maximum)."""
    if inputs.sinks is None:
        return acc, m, denom
    xp = inputs.xp
    sink = per_head_column(inputs, inputs.sinks, m.dtype)
    top = xp.maximum(m, sink)
    alpha = xp.exp(m - top)
    return acc * alpha, top, denom * alpha + xp.exp(sink - top)


def safe_max(xp: Any, s: Any) -> Any:
    """Row maximum, with ``-inf`` rows (a bias hid everything) replaced by 0 so ``s - m``
    is finite."""
    return finite_or_zero(xp, xp.max(s, axis=-1, keepdims=True))


def finite_or_zero(xp: Any, m: Any) -> Any:
    """``m`` with ``-inf`` (a row with nothing allowed yet) replaced by 0."""
    return xp.where(is_minus_inf(xp, m), xp.zeros_like(m), m)


def split_nonfinite(xp: Any, v: Any) -> tuple[Any, Any]:
    """``(clean, bad)``: the values with non-finite entries set to 0, and a column
    ``(..., Lk, 1)`` that is 1 for keys whose value row held one (None when none does).

    A masked key has weight exactly 0, but ``0 * NaN`` is NaN: multiplying by the clean
    values keeps masked positions out of the result, and :func:`attend_values` makes
    the rows that do attend a non-finite value NaN (the rule in docs/semantics.md)."""
    finite = xp.isfinite(v)
    if values_readable(v) and bool(xp.all(finite)):  # the usual case: nothing to do
        return v, None
    clean = xp.where(finite, v, xp.zeros_like(v))
    bad = xp.any(xp.logical_not(finite), axis=-1, keepdims=True)
    return clean, cast(xp, bad, v.dtype)


def attend_values(xp: Any, p: Any, clean: Any, bad: Any, tile: Scores,
                  matmul: Any = None) -> Any:
    """``p @ v`` for values split by :func:`split_nonfinite`; ``tile`` are the scores
    the weights ``p`` came from; ``matmul`` the product (``xp.matmul`` by default)."""
    matmul = xp.matmul if matmul is None else matmul
    pv = matmul(p, clean)
    if bad is None:
        return pv
    # A row attends every key its scores do not hide, also one whose weight
    # underflowed to 0: in exact arithmetic that weight times NaN is NaN too.
    attended = matmul(cast(xp, tile.visible(xp), p.dtype), bad) > 0
    return xp.where(attended, xp.full_like(pv, math.nan), pv)


def finish(xp: Any, acc: Any, m: Any, denom: Any) -> tuple[Any, Any, Any]:
    """Normalise an accumulated output: ``(out, lse, has_mass)``, out 0 on empty rows;
    their lse is finite until :func:`with_empty_rows` (once per call: it may sync)."""
    has_mass = denom > 0
    safe = xp.where(has_mass, denom, xp.ones_like(denom))
    return acc / safe, (m + xp.log(safe))[..., 0], has_mass[..., 0]


def with_empty_rows(xp: Any, lse: Any, has_mass: Any) -> Any:
    """``lse`` with ``-inf`` in the rows without mass; an infinity is made only when
    there are such rows, or their values cannot be read (under a compiler). Reading
    them is a host sync on a device: once per call."""
    if values_readable(has_mass) and bool(xp.all(has_mass)):
        return lse
    return xp.where(has_mass, lse, -math.inf)


def is_empty(inputs: AttentionInputs) -> bool:
    """No query, no key, or no (batch, head) row: nothing to compute or reduce over."""
    return (inputs.q_len == 0 or inputs.kv_len == 0
            or math.prod(inputs.batch_shape) * inputs.num_heads == 0)


def empty_result(inputs: AttentionInputs) -> tuple[Any, Any]:
    """Output zeros and lse ``-inf`` (each head's sink, with sinks) for calls with no
    keys (or no queries, or rows)."""
    xp = inputs.xp
    lead = (*inputs.batch_shape, inputs.num_heads, inputs.q_len)
    out = _full(xp, (*lead, inputs.value_head_dim), 0.0, inputs.query.dtype, inputs.device_obj)
    if inputs.sinks is None:
        lse = _full(xp, lead, -math.inf, inputs.compute_dtype, inputs.device_obj)
    else:
        lse = (_full(xp, lead, 0.0, inputs.compute_dtype, inputs.device_obj)
               + cast(xp, inputs.sinks, inputs.compute_dtype)[..., None])
    return out, lse


def empty_weights(inputs: AttentionInputs) -> Any:
    """The zero weights ``(..., Hq, Lq, Lk)`` of a call with no keys (or no queries,
    or rows)."""
    shape = (*inputs.batch_shape, inputs.num_heads, inputs.q_len, inputs.kv_len)
    return _full(inputs.xp, shape, 0.0, inputs.query.dtype, inputs.device_obj)


def _full(xp: Any, shape: tuple[int, ...], value: float, dtype: Any, device: Any) -> Any:
    # Allocated with every axis at least 1, then sliced: Dask's automatic chunking
    # divides by zero on some zero-size shapes.
    full = xp.full(tuple(max(n, 1) for n in shape), value, dtype=dtype, device=device)
    return full[tuple(slice(0, n) for n in shape)]
