"""``strategy="auto"``: which strategy moves the keys and values, chosen from what
every rank knows alike (shapes, dtype, the number of ranks, the mask's structure and
the layout), never from data or a rank's own timing: every rank must choose the same
strategy or the collectives deadlock. :func:`explain` says what it chose and why.

The rule, in order (figures in ``docs/context_parallel.md``, "Choosing a strategy"):

1. one rank: ``"ring"`` (nothing moves);
2. ``"all_gather"`` when the whole K/V of all ranks is at most
   :data:`ALL_GATHER_BYTES` (short sequences: one collective, and the fastest there);
3. ``"ulysses"`` when it can run (heads divide by the ranks, a mask that does not vary
   by head) and sends fewer bytes than the ring;
4. ``"all_gather"`` when the whole K/V is no larger than a rank's own queries and
   output (few K/V heads per query head): gathering it at most doubles what a rank
   holds;
5. ``"ring"``: memory for 1.25 K/V shards besides a rank's own (they travel in
   pieces), whatever the length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._lib import dtype_name
from ..masks import Mask, dense, head_dependence
from ._strategies import PIECES
from ._ulysses import heads_problem

if TYPE_CHECKING:
    from ._layout import Layout

__all__ = ["ALL_GATHER_BYTES", "AUTO", "StrategyChoice", "StrategyOption", "choose",
           "mask_heads_problem"]

AUTO = "auto"

ALL_GATHER_BYTES = 4 * 2**20
"""Whole K/V (every rank's key and value shards together) up to which ``"auto"``
gathers it at once rather than passing it round the ring."""

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class StrategyOption:
    """One strategy as :func:`explain` judges it for a call."""

    name: str
    reasons: tuple[str, ...]
    """Why it cannot run the call (empty: it can)."""
    sends: int
    """Bytes each rank sends in the forward (the backward of ``"ring"`` sends about
    2.3 times as much, of ``"all_gather"`` twice)."""
    holds: int
    """Bytes of K/V a rank holds at once during the forward besides its own shards
    (``"all_gather"``: the whole gathered K/V, its own shard's copy included)."""


@dataclass(frozen=True)
class StrategyChoice:
    """What ``strategy="auto"`` runs for a call, as :func:`explain` returns it.

    ``strategy`` is the chosen strategy, ``why`` the rule that chose it, ``options``
    every strategy with the reasons it cannot run (empty when it can) and the bytes
    each rank sends and holds; ``str(choice)`` reads like a report of all of it.

    Example:
        >>> import numpy as np
        >>> from portattn import distributed
        >>> q = np.zeros((1, 4, 256, 32), dtype=np.float32)
        >>> choice = distributed.explain(q, q, q, size=2)
        >>> choice.strategy, choice.option("ring").sends, choice.option("ring").reasons
        ('all_gather', 262144, ())
    """

    strategy: str
    why: str
    options: tuple[StrategyOption, ...]
    size: int
    inputs: str

    def option(self, name: str) -> StrategyOption:
        """The :class:`StrategyOption` of strategy ``name``."""
        for option in self.options:
            if option.name == name:
                return option
        msg = f"no strategy named {name!r}; got name={name!r}"
        raise KeyError(msg)

    def __str__(self) -> str:
        lines = [f"strategy: {self.strategy} ({self.why})", "inputs:", self.inputs,
                 "strategies (bytes each rank sends per forward; holds from other ranks):"]
        for o in self.options:
            verdict = "chosen" if o.name == self.strategy else \
                ("; ".join(o.reasons) or "can run")
            lines.append(f"    {o.name}: {verdict}; sends {_size(o.sends)}, holds "
                         f"{_size(o.holds)}")
        return "\n".join(lines)


def mask_heads_problem(mask: Any) -> str | None:
    """Why ``mask`` may differ between heads, which ``"ulysses"`` (each rank attends
    for some of the heads) cannot take; None when it does not."""
    if mask is None:
        return None
    if not isinstance(mask, Mask):
        mask = dense(mask)
    why = head_dependence(mask)
    return None if why is None else f"mask: {why}"


def choose(query: Any, key: Any, value: Any, *, size: int, mask: Any,
           queries: Layout, keys: Layout) -> StrategyChoice:
    """The :class:`StrategyChoice` of a call with these shards over ``size`` ranks
    (``queries``, ``keys``: the validated layouts); reads shapes and dtypes only."""
    item = _itemsize(query.dtype)
    lead = math.prod(int(n) for n in query.shape[:-3])
    hq, hkv = query.shape[-3], key.shape[-3]
    d, dv = query.shape[-1], value.shape[-1]
    sq, sk = queries.shard_length, keys.shard_length
    q_bytes = lead * hq * sq * d * item
    out_bytes = lead * hq * sq * dv * item
    lse_bytes = lead * hq * sq * max(item, 4)
    kv_bytes = lead * hkv * sk * (d + dv) * item  # one rank's key and value shards
    whole_kv = size * kv_bytes
    share = (size - 1) / size  # of its shards a rank sends in an all-to-all

    ulysses_reasons = tuple(r for r in (heads_problem(query, key, size),
                                        mask_heads_problem(mask)) if r)
    # the ring's shard in use and the next arriving, in pieces: 1 + 1 / PIECES shards
    ring_holds = min(kv_bytes * (PIECES + 1) // PIECES, (size - 1) * kv_bytes)
    options = (
        StrategyOption("ring", (), (size - 1) * kv_bytes, ring_holds),
        StrategyOption("all_gather", (), (size - 1) * kv_bytes, whole_kv),
        StrategyOption("ulysses", ulysses_reasons,
                       round(share * (q_bytes + kv_bytes + out_bytes + lse_bytes)),
                       q_bytes + kv_bytes + out_bytes))
    ring, ulysses = options[0], options[2]
    if size == 1:
        strategy, why = "ring", "one rank: nothing moves"
    elif whole_kv <= ALL_GATHER_BYTES:
        strategy = "all_gather"
        why = (f"the whole K/V, {_size(whole_kv)}, is at most "
               f"{_size(ALL_GATHER_BYTES)}: one collective instead of {size - 1} shifts")
    elif not ulysses.reasons and ulysses.sends < ring.sends:
        strategy = "ulysses"
        why = (f"heads divide by {size} ranks, and it sends {_size(ulysses.sends)} "
               f"to the ring's {_size(ring.sends)}")
    elif whole_kv <= q_bytes + out_bytes:
        strategy = "all_gather"
        why = (f"the whole K/V, {_size(whole_kv)}, is no larger than a rank's queries "
               f"and output ({_size(q_bytes + out_bytes)}): few K/V heads")
    else:
        strategy = "ring"
        why = (f"the whole K/V, {_size(whole_kv)}, is larger than a rank's queries and "
               "output; " + ("; ".join(ulysses.reasons) if ulysses.reasons
                             else f"ulysses would send {_size(ulysses.sends)} to the "
                                  f"ring's {_size(ring.sends)}"))
    inputs = "\n".join([
        f"    query : shard shape={tuple(query.shape)} dtype={dtype_name(query.dtype)}",
        f"    key   : shard shape={tuple(key.shape)} dtype={dtype_name(key.dtype)}",
        f"    value : shard shape={tuple(value.shape)} dtype={dtype_name(value.dtype)}",
        f"    size={size} layout={queries.kind} query_length={queries.length} "
        f"key_length={keys.length} mask={mask!r}"])
    return StrategyChoice(strategy, why, options, size, inputs)


def _itemsize(dtype: Any) -> int:
    name = dtype_name(dtype)
    if name in _ITEMSIZE:
        return _ITEMSIZE[name]
    size = getattr(dtype, "itemsize", None)
    return size if isinstance(size, int) else 4


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
