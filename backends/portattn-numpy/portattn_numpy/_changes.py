"""A call's score change (``portattn.scores``) as the loops add it to their score tiles.

A change whose entries depend on the distance ``j - i`` alone (T5's buckets, ALiBi's
slopes and their sums: ``ScoreChange.by_distance``) becomes one vector per head, made
once per call in the scores' dtype and base (``log2(e)`` folded in where the scores are
in base 2, so the ``exp2`` loops and the compiled blocks still run). A tile's entries
are then views of it, never copies: a tile row of queries by keys is a contiguous slice
of it (the compiled blocks read those), and a tile held keys by queries is a view of
the vector reversed, one slice per key row, read with a step back from row to row
(NumPy's loops add those).

Any other change (window and pair tables, and sums that hold one) gives the entries of
a range of queries and keys for every batch element and head at once
(``ScoreChange.entries``); a unit needs one head's. So they are made once for all units
that read them, keys by queries, and added like a bias (the scores stay in base e):
for the whole call where they take no more memory than its own arrays (Swin's windows,
short calls), else a band of query rows at a time (``_bands``), which the plan's query
tiles are cut to fit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from portattn.scores import ScoreChange

from ._problem import head_view
from ._threads import run_parallel

__all__ = ["Shift", "distance_entries", "entries_lead", "hiding_only", "may_hide", "shift_of"]

#: Fewest keys a thread makes the entries of at a time.
_KEYS_PER_RUN = 64


class Shift:
    """The call's score change, bound to its shapes, dtype and base.

    By distance, :attr:`forward` holds the entries: ``(Hq, Lq + Lk - 1)``, C-contiguous,
    the entry of query ``i`` and key ``j`` at ``j - i + Lq - 1``; :attr:`backward` is it
    reversed along its last axis. Else :attr:`entries` holds those of the queries and
    keys from :attr:`corner` on that the units now running read (:meth:`make`): full
    rank ``(*batch|1, Hq, keys, queries)``, C-contiguous. Both are in the scores' dtype
    and base.
    """

    def __init__(self, change: ScoreChange, q_len: int, kv_len: int, rank: int, dtype: Any,
                 forward: Any = None, lead: tuple[int, ...] = (), banded: bool = False) -> None:
        self.change = change
        self.q_len, self.kv_len, self.rank = q_len, kv_len, rank
        self.dtype = np.dtype(dtype)
        self.forward = forward
        self.backward = None if forward is None else np.ascontiguousarray(forward[:, ::-1])
        self.lead = lead
        """The leading axes of the change's entries, ``(*batch|1, Hq)``."""
        self.banded = banded
        """Whether the entries are made a band of query rows at a time (else, where not
        by distance, for the whole call at once)."""
        self.entries: Any = None
        self.corner = (0, 0)

    @property
    def by_distance(self) -> bool:
        """Whether the entries are views of :attr:`forward`."""
        return self.forward is not None

    @property
    def stackable(self) -> bool:
        """Whether :meth:`stacked` gives every entry of a run of heads."""
        return not self.banded

    def make(self, q0: int, q1: int, k0: int, k1: int, threads: int = 1) -> None:
        """Make the entries of queries ``q0:q1`` and keys ``k0:k1``, for every batch
        element and head, in place of those made before, in runs of keys on up to
        ``threads`` threads (the units that read the old ones must have ended: call it
        from the calling thread, between two runs)."""
        self.entries = None  # the old ones go first
        made = np.empty((*self.lead, k1 - k0, q1 - q0), self.dtype)
        step = max(_KEYS_PER_RUN, -(-(k1 - k0) // threads))

        def worker(runs: Any) -> None:
            for c0, c1 in runs:
                part = self.change.entries(np, q0, q1, c0, c1, self.q_len, self.kv_len,
                                           self.rank)
                made[..., c0 - k0:c1 - k0, :] = np.asarray(part).swapaxes(-1, -2)

        run_parallel(worker, [(c0, min(k1, c0 + step)) for c0 in range(k0, k1, step)],
                     threads)
        self.entries, self.corner = made, (q0, k0)

    def origin(self, q0: int) -> int:
        """Where query ``q0``'s entry for key 0 sits in a row of :attr:`forward` (the
        entry of query ``q0 + r`` and key ``k`` is at ``origin - r + k``)."""
        return self.q_len - 1 - q0

    def keys_by_queries(self, b: tuple[int, ...], h: int, q0: int, q1: int, k0: int,
                        k1: int) -> Any:
        """The entries of queries ``q0:q1`` and keys ``k0:k1`` of batch element ``b``,
        head ``h``, keys by queries: a view, its rows contiguous."""
        if self.forward is None:
            r, c = self.corner
            return head_view(self.entries, b, h)[k0 - c:k1 - c, q0 - r:q1 - r]
        row = self.backward[h]
        step = row.strides[0]
        # key k0 + j, query q0 + i: the reversed row at Lk - 1 - k0 + q0 - j + i
        start = self.kv_len - 1 - k0 + q0
        return as_strided(row[start:], (k1 - k0, q1 - q0), (-step, step), writeable=False)

    def add(self, tile: Any, b: tuple[int, ...], h: int, q0: int, q1: int, k0: int,
            k1: int) -> None:
        """Add the entries of queries ``q0:q1`` and keys ``k0:k1`` to a tile held keys
        by queries."""
        np.add(tile, self.keys_by_queries(b, h, q0, q1, k0, k1), out=tile)

    def stacked(self, b: tuple[int, ...], h0: int, kv: int, group: int) -> Any:
        """Every entry of heads ``h0 : h0 + kv * group`` of batch element ``b`` as
        ``(kv|1, group|1, Lk, Lq)``, keys by queries (:attr:`stackable` only)."""
        if self.forward is None:
            whole = self.entries
            lead = tuple(0 if n == 1 else i for i, n in zip(b, whole.shape[:-3], strict=True))
            if whole.shape[-3] == 1:
                return whole[(*lead, slice(0, 1))][None]
            heads = whole[(*lead, slice(h0, h0 + kv * group))]
            return heads.reshape(kv, group, *heads.shape[-2:])
        heads, step = self.backward.strides
        start = self.backward[h0, self.kv_len - 1:]
        return as_strided(start, (kv, group, self.kv_len, self.q_len),
                          (group * heads, heads, -step, step), writeable=False)


def shift_of(change: ScoreChange, per_distance: Any, q_len: int, kv_len: int, rank: int,
             dtype: Any, *, base_e: bool, lead: tuple[int, ...] = (), banded: bool = False,
             threads: int = 1) -> Shift:
    """The call's ``change`` for the loops; ``per_distance``: its
    :func:`distance_entries`. ``base_e``: the scores stay in base e (else ``log2(e)``
    is folded into the entries that go by distance). Entries not by distance, with
    leading axes ``lead`` (:func:`entries_lead`), are made a band of query rows at a
    time where ``banded``, else all at once, here, on up to ``threads`` threads."""
    if per_distance is None:
        shift = Shift(change, q_len, kv_len, rank, dtype, lead=lead, banded=banded)
        if not banded:
            shift.make(0, q_len, 0, kv_len, threads)
        return shift
    # converted in float64: one rounding into the scores' dtype
    wide = per_distance.astype(np.float64) * (1.0 if base_e else math.log2(math.e))
    return Shift(change, q_len, kv_len, rank, dtype,
                 forward=np.ascontiguousarray(wide, dtype=dtype))


def entries_lead(change: ScoreChange, q_len: int, kv_len: int, rank: int) -> tuple[int, ...]:
    """The leading axes of ``change.entries``: ``(*batch|1, Hq)``, the batch axes 1
    where the entries do not differ (read from those of one query and key)."""
    return tuple(change.entries(np, 0, 1, 0, 1, q_len, kv_len, rank).shape[:-2])


def distance_entries(change: ScoreChange, q_len: int, kv_len: int) -> Any:
    """``change.by_distance`` as a NumPy array, or None where the change has none."""
    found = change.by_distance(np, q_len, kv_len)
    return None if found is None else np.asarray(found)


def may_hide(change: ScoreChange | None, q_len: int, kv_len: int) -> bool:
    """Can the change hide a pair (an entry of ``-inf``)? Its entries are values of
    its arrays (or their sums and multiples), so only where one holds a non-finite
    value; by distance, the entries are read themselves."""
    if change is None:
        return False
    per_distance = distance_entries(change, q_len, kv_len)
    if per_distance is not None:
        return bool(np.isneginf(per_distance).any())
    return any(np.issubdtype(np.asarray(a).dtype, np.floating)
               and not np.isfinite(a).all() for a in change.arrays)


class _HidingOnly(ScoreChange):
    """A change's ``-inf`` entries, every other entry 0: what hides a key, and no
    weight besides (``_call`` finds the rows that attend a non-finite value with it)."""

    def __init__(self, change: ScoreChange) -> None:
        self.inner = change
        self.arrays = change.arrays
        self.trainable = (False,) * len(change.arrays)

    def __repr__(self) -> str:
        return f"hiding_only({self.inner!r})"

    @property
    def rank(self) -> int:
        return self.inner.rank

    def by_distance(self, xp: Any, q_len: int, kv_len: int) -> Any:
        found = distance_entries(self.inner, q_len, kv_len)
        return None if found is None else _hiding(found)

    def entries(self, xp: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
                kv_len: int, rank: int) -> Any:
        return _hiding(np.asarray(self.inner.entries(np, q0, q1, k0, k1, q_len, kv_len,
                                                     rank)))


def _hiding(entries: Any) -> Any:
    return np.where(np.isneginf(entries), entries, np.zeros_like(entries))


def hiding_only(change: ScoreChange | None) -> ScoreChange | None:
    """``change`` with its ``-inf`` entries kept and every other entry 0."""
    return None if change is None else _HidingOnly(change)
