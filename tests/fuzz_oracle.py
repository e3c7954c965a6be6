"""A float64 NumPy attention oracle for the fuzzer, written from the contract alone.

It shares no code with portattn's kernels or masks: calls are plain data
(:class:`Spec`), the boolean mask is built here from the definitions in the design
(positions, alignment, lengths, dense), and the softmax is the textbook one.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass(frozen=True)
class Spec:
    """One random call as data. ``whole`` is the problem a restricted mask was cut from:
    ``(LQ, LK, q0, k0)``, the call being ``query[q0:q0+lq] x key[k0:k0+lk]``."""

    batch: tuple[int, ...]
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    dv: int
    dtype: str
    parts: tuple[tuple[Any, ...], ...]
    """Intersected parts, each ``(kind, *parameters)`` (see :func:`part_mask`); lengths
    and ranges are flat tuples; ``("union", part, part)`` joins two parts."""
    whole: tuple[int, int, int, int] | None
    bias: tuple[tuple[int, ...], str, float] | None
    """``(shape, dtype, magnitude)``."""
    scale: float | None
    softcap: float | None
    lse: bool
    length_dtype: str
    seed: int
    alibi: tuple[int, ...] | None = None
    """The shape of ``alibi_slopes``: ``(Hq,)`` or ``(*batch, Hq)``."""
    sinks: bool = False


def mask_function(name: str) -> Callable[..., Any]:
    """Mask functions ``fn(b, h, q_idx, kv_idx)`` of the fuzzer, by name; operators only,
    so one function serves every library and this oracle."""
    return {
        "strided": lambda b, h, q, k: ((q - k) % (h + 2) == 0) | (k <= b),
        "near": lambda b, h, q, k: (q - k <= 3) & (k - q <= 3 + h),
    }[name]


def data_shapes(spec: Spec) -> list[tuple[str, tuple[int, ...]]]:
    """The random arrays the parts need, in order: ``(what, shape)``."""
    big_q, big_k = (spec.lq, spec.lk) if spec.whole is None else spec.whole[:2]
    found = []

    def visit(part: tuple[Any, ...]) -> None:
        kind, *args = part
        if kind == "union":
            for member in args:
                visit(member)
        elif kind == "dense":
            found.append(("dense", args[0]))
        elif kind == "documents":
            lead = () if args[0] else spec.batch
            found.append(("ids", (*lead, big_q)))
            found.append(("ids", (*lead, big_k)))
        elif kind == "layout":
            block_q, block_k = args
            found.append(("layout", (-(-big_k // block_q), -(-big_k // block_k))))

    for part in spec.parts:
        visit(part)
    return found


def draw_data(spec: Spec, rng: np.random.Generator) -> list[np.ndarray]:
    """The arrays of :func:`data_shapes`: dense masks, sorted segment ids, layouts."""
    data = []
    for what, shape in data_shapes(spec):
        if what == "ids":  # packed documents: sorted ids, padding (-1) first
            data.append(np.sort(rng.integers(-1, 4, shape), axis=-1))
        else:
            data.append(rng.random(shape) < (0.7 if what == "dense" else 0.5))
    return data


def whole_mask(spec: Spec, data: list[np.ndarray]) -> np.ndarray | None:
    """``(*batch, Hq, LQ, LK)`` booleans (True = attend) on the whole problem."""
    if not spec.parts:
        return None
    big_q, big_k = (spec.lq, spec.lk) if spec.whole is None else spec.whole[:2]
    full = np.ones((*spec.batch, spec.hq, big_q, big_k), dtype=bool)
    arrays = iter(data)
    for part in spec.parts:
        full = full & part_mask(spec, part, arrays, big_q, big_k)
    return full


def part_mask(spec: Spec, part: tuple[Any, ...], arrays: Any, big_q: int,
              big_k: int) -> np.ndarray:
    """One part's pairs, from the definitions: query ``i`` sits at position
    ``i + LK - LQ`` (bottom-right), ``i`` for top-left causal."""
    i = np.arange(big_q)[:, None]
    j = np.arange(big_k)[None, :]
    pos = i + big_k - big_q
    tail = (1, 1, 1)  # per-sequence values broadcast over heads, queries and keys

    def per_batch(values: Any) -> np.ndarray:
        return np.asarray(values, dtype=np.int64).reshape((*spec.batch, *tail))

    kind, *args = part
    if kind == "causal":
        return j <= (pos if args[0] == "bottom_right" else i)
    if kind == "window":
        left, right = args
        allowed = np.ones((big_q, big_k), dtype=bool)
        if left is not None:
            allowed = allowed & (j >= pos - left)
        if right is not None:
            allowed = allowed & (j <= pos + right)
        return allowed
    if kind == "key_lengths":
        return j < per_batch(args[0])
    if kind == "query_lengths":
        return i < per_batch(args[0])
    if kind in ("key_ranges", "query_ranges"):
        index = j if kind == "key_ranges" else i
        return (per_batch(args[0]) <= index) & (index < per_batch(args[1]))
    if kind == "prefix":
        n = per_batch(args[0])
        return (pos >= 0) & (pos < n) & (j < n)
    if kind == "sinks":
        return np.broadcast_to(j < args[0], (big_q, big_k))
    if kind == "global":
        chosen = {p for p in args[0] if p >= 0}
        rows = np.isin(pos, list(chosen))
        return rows | np.isin(j, list(chosen))
    if kind == "chunks":
        return (pos >= 0) & (pos // args[0] == j // args[0])
    if kind == "layout":
        block_q, block_k = args
        layout = next(arrays)
        return (pos >= 0) & layout[np.maximum(pos, 0) // block_q, j // block_k]
    if kind == "documents":
        q_ids, k_ids = next(arrays), next(arrays)
        q_ids = q_ids.reshape((*q_ids.shape[:-1], 1, big_q, 1))
        k_ids = k_ids.reshape((*k_ids.shape[:-1], 1, 1, big_k))
        return (q_ids == k_ids) & (q_ids >= 0)
    if kind == "function":
        n = int(np.prod(spec.batch))
        b = np.arange(n).reshape((*spec.batch, *tail))
        h = np.arange(spec.hq).reshape(spec.hq, 1, 1)
        return np.asarray(mask_function(args[0])(b, h, i, j), dtype=bool)
    if kind == "dense":
        return next(arrays)
    if kind == "union":
        return part_mask(spec, args[0], arrays, big_q, big_k) | part_mask(
            spec, args[1], arrays, big_q, big_k)
    msg = f"unknown part {part!r}"
    raise ValueError(msg)


def local_mask(spec: Spec, data: list[np.ndarray]) -> np.ndarray | None:
    """The call's own ``(*batch, Hq, Lq, Lk)`` mask (the whole one, cut to the call)."""
    full = whole_mask(spec, data)
    if full is None or spec.whole is None:
        return full
    q0, k0 = spec.whole[2:]
    return full[..., q0:q0 + spec.lq, k0:k0 + spec.lk]


def _scores(q: np.ndarray, k: np.ndarray, allowed: np.ndarray | None,
            bias: np.ndarray | None, alibi: np.ndarray | None, scale: float | None,
            softcap: float | None) -> tuple[np.ndarray, np.ndarray, float]:
    """``(masked scores, raw scaled scores, scale)``: softcap, bias and ALiBi
    (``-slope * |i + Lk - Lq - j|``) applied, in that order, then the mask."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    raw = np.einsum("...id,...jd->...ij", q, k) * scale
    s = raw if softcap is None else softcap * np.tanh(raw / softcap)
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)
    if alibi is not None:
        lq, lk = s.shape[-2:]
        distance = np.abs(np.arange(lq)[:, None] + lk - lq - np.arange(lk)[None, :])
        s = s - np.asarray(alibi, dtype=np.float64)[..., None, None] * distance
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    return s, raw, scale


def _softmax(s: np.ndarray, sinks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``(weights, lse)`` over the last axis (``lse`` keeps its axis), with one sink
    logit per head in each row's denominator; a row with nothing gives weights 0 and
    an lse of ``-inf``."""
    sink = None if sinks is None else np.asarray(sinks, dtype=np.float64)[..., None, None]
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    if sink is not None:
        m = np.maximum(m, sink)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - m))
    empty = total == 0
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, total)))
    return p / np.where(empty, 1.0, total), lse


def attention64(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray | None,
                bias: np.ndarray | None, scale: float | None, softcap: float | None, *,
                alibi: np.ndarray | None = None, sinks: np.ndarray | None = None,
                ) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` in float64; fully masked rows give 0 and ``-inf`` (with sinks:
    0 and the sink)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    s, _, _ = _scores(q, k, allowed, bias, alibi, scale, softcap)
    w, lse = _softmax(s, sinks)
    return np.einsum("...ij,...jd->...id", w, v), lse[..., 0]


def gradients64(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray | None,
                bias: np.ndarray | None, scale: float | None, softcap: float | None,
                dout: np.ndarray, dlse: np.ndarray | None,
                stored_out: np.ndarray | None = None, *, alibi: np.ndarray | None = None,
                sinks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq, dk, dv)`` of ``sum(out * dout) + sum(lse * dlse)`` in float64, by the
    chain rule written out (``dlse`` is ignored on fully masked rows).

    ``stored_out``: the output as a flash backward reads it (rounded to a half dtype,
    as FlashAttention stores it). ``Delta = rowsum(dO * O)`` is then taken from it, so
    the result is what such a backward computes exactly."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    hkv, group = k.shape[-3], q.shape[-3] // k.shape[-3]
    kk, vv = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    s, raw, scale = _scores(q, kk, allowed, bias, alibi, scale, softcap)
    if s.shape[-1] == 0:
        return np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    w, _ = _softmax(s, sinks)  # fully masked rows: all zeros
    out = np.einsum("...ij,...jd->...id", w, vv) if stored_out is None else stored_out
    delta = (dout * out).sum(axis=-1, keepdims=True)  # = rowsum(w * dw) when exact
    dw = np.einsum("...id,...jd->...ij", dout, vv)
    ds = w * (dw - delta)
    if dlse is not None:
        ds = ds + w * dlse[..., None]  # d lse / d s = the weights
    if softcap is not None:
        ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
    dq = np.einsum("...ij,...jd->...id", ds, kk) * scale
    dk = np.einsum("...ij,...id->...jd", ds, q) * scale
    dv = np.einsum("...ij,...id->...jd", w, dout)

    def per_kv_head(g):  # the group's query heads share one key/value head
        return g.reshape(*g.shape[:-3], hkv, group, *g.shape[-2:]).sum(axis=-3)

    return dq, per_kv_head(dk), per_kv_head(dv)


#: ``(backend, kernel, verdict) -> count``; the conftest prints it after the run.
COUNTS: Counter[tuple[str, str, str]] = Counter()
