"""A float64 NumPy attention oracle for the fuzzer, written from the contract alone.

It shares no code with portattn's kernels or masks: calls are plain data
(:class:`Spec`), the boolean mask is built here from the definitions in the design
(positions, alignment, lengths, dense), and the softmax is the textbook one.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np


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
    """``("causal", alignment)``, ``("window", left, right)``, ``("key_lengths", ints)``,
    ``("query_lengths", ints)``, ``("dense", shape)``; lengths are flat tuples."""
    whole: tuple[int, int, int, int] | None
    bias: tuple[tuple[int, ...], str, float] | None
    """``(shape, dtype, magnitude)``."""
    scale: float | None
    softcap: float | None
    lse: bool
    length_dtype: str
    seed: int


def whole_mask(spec: Spec, dense: list[np.ndarray]) -> np.ndarray | None:
    """``(*batch, Hq, LQ, LK)`` booleans (True = attend) on the whole problem."""
    big_q, big_k = (spec.lq, spec.lk) if spec.whole is None else spec.whole[:2]
    i = np.arange(big_q)[:, None]
    j = np.arange(big_k)[None, :]
    full = np.ones((*spec.batch, spec.hq, big_q, big_k), dtype=bool)
    tail = (1, 1, 1)  # lengths broadcast over heads, queries and keys
    dense_arrays = iter(dense)
    if not spec.parts:
        return None
    for kind, *args in spec.parts:
        if kind == "causal":
            pos = i + (big_k - big_q if args[0] == "bottom_right" else 0)
            full = full & (j <= pos)
        elif kind == "window":
            left, right = args
            pos = i + big_k - big_q
            if left is not None:
                full = full & (j >= pos - left)
            if right is not None:
                full = full & (j <= pos + right)
        elif kind == "key_lengths":
            n = np.asarray(args[0], dtype=np.int64).reshape((*spec.batch, *tail))
            full = full & (j < n)
        elif kind == "query_lengths":
            n = np.asarray(args[0], dtype=np.int64).reshape((*spec.batch, *tail))
            full = full & (i < n)
        elif kind == "dense":
            full = full & next(dense_arrays)
    return full


def local_mask(spec: Spec, dense: list[np.ndarray]) -> np.ndarray | None:
    """The call's own ``(*batch, Hq, Lq, Lk)`` mask (the whole one, cut to the call)."""
    full = whole_mask(spec, dense)
    if full is None or spec.whole is None:
        return full
    q0, k0 = spec.whole[2:]
    return full[..., q0:q0 + spec.lq, k0:k0 + spec.lk]


def attention64(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray | None,
                bias: np.ndarray | None, scale: float | None, softcap: float | None
                ) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` in float64; fully masked rows give 0 and ``-inf``."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("...id,...jd->...ij", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    out_shape = (*s.shape[:-1], v.shape[-1])
    if s.shape[-1] == 0:
        return np.zeros(out_shape), np.full(s.shape[:-1], -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    empty = total == 0
    w = p / np.where(empty, 1.0, total)
    out = np.einsum("...ij,...jd->...id", w, v)
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, np.log(np.where(empty, 1.0, total)) + m)[..., 0]
    return out, lse


def gradients64(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray | None,
                bias: np.ndarray | None, scale: float | None, softcap: float | None,
                dout: np.ndarray, dlse: np.ndarray | None,
                stored_out: np.ndarray | None = None,
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq, dk, dv)`` of ``sum(out * dout) + sum(lse * dlse)`` in float64, by the
    chain rule written out (``dlse`` is ignored on fully masked rows).

    ``stored_out``: the output as a flash backward reads it (rounded to a half dtype,
    as FlashAttention stores it). ``Delta = rowsum(dO * O)`` is then taken from it, so
    the result is what such a backward computes exactly."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    hkv, group = k.shape[-3], q.shape[-3] // k.shape[-3]
    kk, vv = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    raw = np.einsum("...id,...jd->...ij", q, kk) * scale
    s = raw if softcap is None else softcap * np.tanh(raw / softcap)
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    if s.shape[-1] == 0:
        return np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    w = p / np.where(total == 0, 1.0, total)  # fully masked rows: all zeros
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
