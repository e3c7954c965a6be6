"""flash-attn's arguments read and checked (:mod:`portattn.flash_attn`): windows,
softcap, dropout, the declared maxima, heads, block tables and cache lengths read on
the host. Each error names the argument and its value."""

from __future__ import annotations

import numbers
import operator
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from .. import masks
from .._lib import check_like, dtype_name
from ._checks import host_ints, int_at_least

if TYPE_CHECKING:
    from ..masks import Mask

__all__ = ["cache_lengths", "check_arrays", "check_dropout", "check_heads", "check_max",
           "check_pages", "check_rising", "check_slopes", "host_table", "short", "softcap",
           "window_mask"]


def check_slopes(xp: Any, dev: Any, alibi_slopes: Any, sequences: int,
                  heads: int) -> None:
    if alibi_slopes is None:
        return
    check_like(xp, dev, alibi_slopes, "alibi_slopes", "q")
    if tuple(alibi_slopes.shape) not in ((heads,), (sequences, heads)):
        msg = (f"alibi_slopes must have shape (Hq,)=({heads},) or (batch, Hq)="
               f"({sequences}, {heads}); got alibi_slopes.shape={tuple(alibi_slopes.shape)}")
        raise ValueError(msg)


def window_mask(causal: bool, window_size: Any) -> Mask | None:
    """flash-attn's ``causal`` and ``window_size`` as a mask (None: every key)."""
    try:
        left, right = (operator.index(w) for w in window_size)
    except (TypeError, ValueError):
        left = right = None
    else:
        if min(left, right) >= -1:
            left = None if left == -1 else left
            right = 0 if causal else (None if right == -1 else right)
            if left is None and right is None:
                return None
            return masks.causal() if left is None and right == 0 else masks.sliding_window(
                left, right)
    msg = (f"window_size must be a pair of ints >= -1 (-1: unbounded); got "
           f"window_size={window_size!r}")
    raise ValueError(msg)


def softcap(softcap: Any) -> float | None:
    if isinstance(softcap, numbers.Real) and not isinstance(softcap, bool) and softcap >= 0:
        return float(softcap) or None
    msg = f"softcap must be a number >= 0 (0.0: none); got softcap={softcap!r}"
    raise ValueError(msg)


def check_dropout(dropout_p: Any) -> None:
    if dropout_p != 0:
        msg = (f"dropout_p={dropout_p!r} is not supported here (paged attention has no "
               f"dropout); pass 0.0, or pad into a batch and use portattn.attention(..., "
               f"dropout_p=..., dropout_seed=...)")
        raise ValueError(msg)


def check_max(name: str, value: Any, counts: list[int], what: str) -> None:
    most = max(counts, default=0)
    if int_at_least(name, value) < most:
        msg = (f"{name} must be at least the most {what} of a sequence ({most}); got "
               f"{name}={value!r}")
        raise ValueError(msg)


def check_arrays(xp: Any, dev: Any, first: tuple[str, Any], *rest: tuple[str, Any]) -> None:
    anchor, a = first
    for name, b in rest:
        check_like(xp, dev, b, name, anchor)
        if b.dtype != a.dtype:
            msg = (f"{name}.dtype={dtype_name(b.dtype)} differs from "
                   f"{anchor}.dtype={dtype_name(a.dtype)}")
            raise TypeError(msg)


def check_heads(q: tuple[int, int], k: tuple[int, int], qname: str, kname: str) -> None:
    """``(H, D)`` of the queries and keys: one ``D``, ``Hq`` a multiple of ``Hkv``."""
    if q[1] != k[1] or k[0] == 0 or q[0] % k[0]:
        msg = (f"{qname} and {kname} must have one head dimension and a multiple of "
               f"{kname}'s heads in {qname}; got {qname} heads={q[0]}, D={q[1]} and "
               f"{kname} heads={k[0]}, D={k[1]}")
        raise ValueError(msg)


def host_table(xp: Any, dev: Any, block_table: Any, batch: int,
                what: str) -> list[list[int]]:
    if getattr(block_table, "ndim", None) != 2 or block_table.shape[0] != batch:
        msg = (f"block_table must be (B, W) with B={what}={batch}; got "
               f"block_table.shape={tuple(getattr(block_table, 'shape', ()))}")
        raise ValueError(msg)
    flat = host_ints(xp, dev, xp.reshape(block_table, (-1,)), "block_table", None, "q")
    width = block_table.shape[1]
    return [flat[b * width:(b + 1) * width] for b in range(batch)]


def cache_lengths(xp: Any, dev: Any, cache_seqlens: Any, batch: int, capacity: int,
                   new: int) -> list[int]:
    """The keys each element holds before the new ones, checked against the room."""
    if cache_seqlens is None:
        if new:
            msg = (f"cache_seqlens must be given with k and v (None means a full cache of "
                   f"{capacity} keys, with no room for {new} more)")
            raise ValueError(msg)
        return [capacity] * batch
    if hasattr(cache_seqlens, "shape"):
        shape = () if not cache_seqlens.shape else (batch,)
        held = host_ints(xp, dev, cache_seqlens, "cache_seqlens", shape, "q")
        held = held * batch if not shape else held
    else:
        held = [int_at_least("cache_seqlens", cache_seqlens)] * batch
    for b, n in enumerate(held):
        if not 0 <= n <= capacity - new:
            msg = (f"cache_seqlens[{b}]={n} must lie in [0, {capacity - new}]: the cache "
                   f"holds {capacity} keys per element and {new} new ones are written "
                   f"after them")
            raise ValueError(msg)
    return held


def check_pages(table: list[list[int]], lengths: list[int], page: int, pages: int) -> None:
    """Every page an element reads (or writes) is one of the pool's."""
    for b, n in enumerate(lengths):
        bad = [p for p in table[b][:-(-n // page)] if not 0 <= p < pages][:4]
        if bad:
            msg = (f"block_table[{b}] names pages outside the pool of {pages} within the "
                   f"element's {n} keys; got pages {bad}")
            raise ValueError(msg)


def check_rising(values: list[int], name: str) -> None:
    if (values and values[0] < 0) or any(b < a for a, b in pairwise(values)):
        msg = f"{name} must be non-decreasing from >= 0; got {name}={short(values)}"
        raise ValueError(msg)


def short(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...]"
