"""Masks whose extent differs per sequence: key/query ranges and per-sequence windows.

- :class:`KeyRanges` / :class:`QueryRanges`: batch element ``b`` keeps keys (queries)
  ``start[b] <= j < stop[b]``: left and right padding at once.
- :class:`SequenceWindow`: causal and sliding windows aligned to each sequence's own
  lengths, flash-attn's varlen convention: query ``i`` of ``b`` sits at position
  ``i + key_lengths[b] - query_lengths[b]`` (batched decoding with caches of
  different lengths needs exactly this).

Their tiles depend on array values. When a mask is bound to a call whose arrays can
be read it keeps their host copies, from which :meth:`block_states` (and
:meth:`key_range`, :meth:`hides`, :meth:`covers`, through their extremes) tell the
kernels which tiles to skip; without them (traced or lazy arrays) every tile is
visited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .._lib import host_copy
from ._base import (
    Band,
    Mask,
    along,
    band_states,
    column,
    edges_at_rank,
    per_batch,
    replaced,
    tile_states,
    within,
)
from ._values import array_argument, check_bounds, check_integer_array, signed

__all__ = ["KeyRanges", "QueryRanges", "SequenceWindow"]


class _Ranges(Mask):
    """``start[b] <= index < stop[b]`` along the keys or the queries."""

    start: Any
    stop: Any
    host: tuple[Any, Any] | None
    """``(start, stop)`` on the host, when the values were read."""

    def __post_init__(self) -> None:
        for name in ("start", "stop"):
            object.__setattr__(self, name, array_argument(
                getattr(self, name), self.kind, "integer arrays with the batch shape", name))

    @property
    def summary(self) -> tuple[int, int, int, int] | None:
        """``(min start, max start, min stop, max stop)``, when the values were read."""
        if self.host is None or self.host[0].size == 0:
            return None
        start, stop = self.host
        return int(start.min()), int(start.max()), int(stop.min()), int(stop.max())

    @property
    def _limit_name(self) -> str:
        return "Lk" if self.kind == "key_ranges" else "Lq"

    @property
    def arrays(self):
        return (self.start, self.stop)

    def with_arrays(self, arrays):
        start, stop = arrays
        # other arrays may hold other values: the copies of these ones are dropped
        return replaced(self, start=start, stop=stop, host=None)

    def for_call(self, xp, batch_shape, num_heads, lq, lk, device=None):
        limit = lk if self.kind == "key_ranges" else lq
        start = check_integer_array(xp, self.start, f"{self.kind} start", batch_shape)
        stop = check_integer_array(xp, self.stop, f"{self.kind} stop", batch_shape)
        for name, a in (("start", start), ("stop", stop)):
            check_bounds(xp, a, limit, f"{self.kind} {name}", self._limit_name)
        host = host_copy(start), host_copy(stop)
        known = not any(h is None for h in host)
        return replaced(self, start=start, stop=stop, host=host if known else None)

    def _span(self, lo: int, hi: int) -> tuple[int, int]:
        """The part of ``[lo, hi)`` that some batch element keeps."""
        if self.summary is None:
            return lo, hi
        min_start, _, _, max_stop = self.summary
        return max(lo, min_start), min(hi, max_stop)

    def _hidden(self, lo: int, hi: int) -> bool:
        start, stop = self._span(lo, hi)
        return start >= stop

    def _kept(self, lo: int, hi: int) -> bool:
        if self.summary is None:
            return False
        _, max_start, min_stop, _ = self.summary
        return max_start <= lo and hi <= min_stop

    def _holds(self, xp: Any, b: Any, index: Any) -> Any:
        return (per_batch(xp, self.start, b) <= index) & (index < per_batch(xp, self.stop, b))

    def _inside(self, xp: Any, lo: int, hi: int, device: Any, axis: int) -> Any:
        start, stop = column(xp, self.start), column(xp, self.stop)
        index = along(xp, xp.arange(lo, hi, device=device), start.ndim, axis)
        return xp.logical_and(start <= index, index < stop)

    def _restricted(self, xp: Any, lo: int, hi: int) -> Mask:
        def cut(a):  # signed: a - lo must not wrap around in an unsigned dtype
            # (asarray: NumPy's clip turns a 0-d array into a scalar)
            return xp.asarray(xp.clip(signed(xp, a) - lo, 0, hi - lo))

        host = None if self.host is None else tuple((a - lo).clip(0, hi - lo) for a in self.host)
        return replaced(self, start=cut(self.start), stop=cut(self.stop), host=host)

    def _states(self, first: Any, last: Any, ranges: Any, xp: Any = None) -> Any:
        """States of blocks ``[first, last]`` along the ranged axis, per batch element,
        for ``ranges``: ``(start, stop)`` shaped ``(*batch, 1, 1, 1)``, or None."""
        if ranges is None:
            return None
        start, stop = ranges
        hidden = (last < start) | (first >= stop) | (start >= stop)
        return tile_states(hidden, (first >= start) & (last < stop), xp)

    def _host_spans(self, length: int) -> tuple[Any, Any] | None:
        """``(start, stop)`` shaped ``(*batch, 1, length)``, from the host copies."""
        if self.host is None:
            return None
        import numpy as np

        start, stop = (np.broadcast_to(a.reshape(*a.shape, 1, 1).astype(np.int64),
                                       (*a.shape, 1, length)) for a in self.host)
        return start, stop

    def _host_ranges(self) -> Any:
        return None if self.host is None else tuple(a.reshape(*a.shape, 1, 1, 1)
                                                    for a in self.host)

    def array_states(self, grid, xp, rank):
        q_first, q_last, k_first, k_last = edges_at_rank(grid, rank)
        first, last = (k_first, k_last) if self.kind == "key_ranges" else (q_first, q_last)
        return self._states(first, last, (column(xp, self.start), column(xp, self.stop)), xp)

    def __repr__(self) -> str:
        return f"{self.kind}(shape={tuple(self.start.shape)})"


@dataclass(frozen=True, eq=False, repr=False)
class KeyRanges(_Ranges):
    """Batch element ``b`` attends keys ``start[b] <= j < stop[b]`` only; made by
    :func:`~portattn.masks.key_ranges`.

    ``start`` and ``stop`` are integer arrays with the batch shape. Once bound to a
    call whose values can be read, ``host`` holds their copies and ``summary`` their
    extremes, ``(min start, max start, min stop, max stop)``.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.key_ranges(np.array([1, 0]), np.array([4, 6]))
        >>> print(masks.text(mask, 2, 6, batch=0))
        .###..
        .###..
        >>> bound = mask.bind(np, (2,), 1, 2, 6)  # batch (2,), 1 head, Lq=2, Lk=6
        >>> bound.summary
        (0, 1, 4, 6)
        >>> bound.covers(0, 2, 1, 4, 2, 6)  # every sequence keeps keys [1, 4)
        True
    """

    kind: ClassVar[str] = "key_ranges"
    start: Any
    stop: Any
    host: tuple[Any, Any] | None = field(default=None, compare=False)

    def key_range(self, q0, q1, lq, lk):
        return self._span(0, lk)

    def key_spans(self, lq, lk):
        return self._host_spans(lq)

    def block_states(self, grid):
        return self._states(grid.k_first[None, :], grid.k_last[None, :], self._host_ranges())

    def hides(self, q0, q1, k0, k1, lq, lk):
        return q0 >= q1 or self._hidden(k0, k1)

    def covers(self, q0, q1, k0, k1, lq, lk):
        return self._kept(k0, k1)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return self._inside(xp, k0, k1, device, -1)

    def allows(self, xp, b, h, q, k, lq, lk):
        return self._holds(xp, b, k)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return self._restricted(xp, k0, k1)


@dataclass(frozen=True, eq=False, repr=False)
class QueryRanges(_Ranges):
    """Queries outside ``start[b] <= i < stop[b]`` are padding, rows that attend
    nothing; made by :func:`~portattn.masks.query_ranges`.

    ``start``, ``stop``, ``host`` and ``summary`` are as for :class:`KeyRanges`.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.query_ranges(np.array([0, 1]), np.array([2, 4]))
        >>> print(masks.text(mask, 4, 6, batch=0))
        ######
        ######
        ......
        ......
    """

    kind: ClassVar[str] = "query_ranges"
    start: Any
    stop: Any
    host: tuple[Any, Any] | None = field(default=None, compare=False)

    def key_range(self, q0, q1, lq, lk):
        return (0, 0) if self._hidden(q0, q1) else (0, lk)

    def key_spans(self, lq, lk):
        ranges = self._host_spans(lq)
        if ranges is None:
            return None
        import numpy as np

        rows = np.arange(lq)
        kept = (ranges[0] <= rows) & (rows < ranges[1])
        return np.zeros(kept.shape, np.int64), np.where(kept, lk, 0).astype(np.int64)

    def block_states(self, grid):
        return self._states(grid.q_first[:, None], grid.q_last[:, None], self._host_ranges())

    def hides(self, q0, q1, k0, k1, lq, lk):
        return k0 >= k1 or self._hidden(q0, q1)

    def covers(self, q0, q1, k0, k1, lq, lk):
        return self._kept(q0, q1)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return self._inside(xp, q0, q1, device, -2)

    def allows(self, xp, b, h, q, k, lq, lk):
        return self._holds(xp, b, q)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return self._restricted(xp, q0, q1)


@dataclass(frozen=True, eq=False, repr=False)
class SequenceWindow(Mask):
    """Query ``i`` of batch element ``b`` sits at ``p = i + key_lengths[b] -
    query_lengths[b] (+ shift)`` and attends keys ``p - left <= j <= p + right``
    (``None``: unbounded). ``left=None, right=0`` is causal. Padding is not part of
    it: :func:`~portattn.masks.sequence_window` and
    :func:`~portattn.masks.sequence_causal` make it intersected with the two length
    masks.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.sequence_window(1, 0, query_lengths=np.array([2, 4]),
        ...                              key_lengths=np.array([3, 6]))
        >>> [part.kind for part in mask.parts]
        ['sequence_window', 'query_lengths', 'key_lengths']
        >>> window = mask.parts_of("sequence_window")[0]
        >>> print(masks.text(window, 4, 6, batch=0))
        ##....
        .##...
        ..##..
        ...##.
        >>> print(masks.text(mask, 4, 6, batch=0))
        ##....
        .##...
        ......
        ......
    """

    kind: ClassVar[str] = "sequence_window"
    query_lengths: Any
    key_lengths: Any
    left: int | None = None
    right: int | None = 0
    shift: int = 0
    host: Any = field(default=None, compare=False)
    """``key_lengths - query_lengths`` on the host, when the lengths were read."""
    cut: bool = False
    """Cut from a larger call by :meth:`Mask.restrict` (its lengths are the whole's)."""

    def __post_init__(self) -> None:
        for name in ("query_lengths", "key_lengths"):
            object.__setattr__(self, name, array_argument(
                getattr(self, name), "sequence_window", "integer arrays with the batch shape",
                name))
        for name in ("left", "right"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                msg = f"sequence_window {name} must be an int >= 0 or None; got {name}={value!r}"
                raise ValueError(msg)

    @property
    def arrays(self):
        return (self.query_lengths, self.key_lengths)

    def with_arrays(self, arrays):
        query_lengths, key_lengths = arrays
        return replaced(self, query_lengths=query_lengths, key_lengths=key_lengths, host=None)

    def structure(self) -> tuple:
        return (self.kind, self.left, self.right, self.shift)

    def for_call(self, xp, batch_shape, num_heads, lq, lk, device=None):
        ql = check_integer_array(xp, self.query_lengths, "sequence_window query_lengths",
                                 batch_shape)
        kl = check_integer_array(xp, self.key_lengths, "sequence_window key_lengths",
                                 batch_shape)
        if not self.cut:  # a part of a larger call cannot check the whole's lengths
            check_bounds(xp, ql, lq, "sequence_window query_lengths", "Lq")
            check_bounds(xp, kl, lk, "sequence_window key_lengths", "Lk")
        return replaced(self, query_lengths=ql, key_lengths=kl, host=host_copy(kl - ql))

    @property
    def summary(self) -> tuple[int, int] | None:
        """``(min offset, max offset)`` over the batch, when the lengths were read."""
        if self.host is None or self.host.size == 0:
            return None
        return int(self.host.min()) + self.shift, int(self.host.max()) + self.shift

    def block_states(self, grid):
        if self.host is None:
            return None
        return self._states(grid, self.host.reshape(*self.host.shape, 1, 1, 1), None, 2)

    def array_states(self, grid, xp, rank):
        return self._states(grid, column(xp, self.key_lengths - self.query_lengths), xp, rank)

    def _states(self, grid: Any, offsets: Any, xp: Any, rank: int) -> Any:
        """``offsets``: each sequence's ``key_lengths - query_lengths``, ``(*batch, 1, 1, 1)``."""
        offset = offsets + self.shift
        return band_states(grid, None if self.left is None else offset - self.left,
                           None if self.right is None else offset + self.right, xp, rank)

    def _outer(self) -> Band | None:
        """Every pair some batch element allows lies in this band."""
        if self.summary is None:
            return None
        low, high = self.summary
        return Band(None if self.left is None else low - self.left,
                    None if self.right is None else high + self.right)

    def key_range(self, q0, q1, lq, lk):
        band = self._outer()
        return (0, lk) if band is None else band.key_range(q0, q1, lk)

    def key_spans(self, lq, lk):
        if self.host is None:
            return None
        import numpy as np

        # query i of b sits at i + key_lengths[b] - query_lengths[b] (+ shift)
        at = np.arange(lq) + self.host.reshape(*self.host.shape, 1, 1).astype(np.int64) + (
            self.shift)
        start = np.zeros_like(at) if self.left is None else at - self.left
        stop = np.full_like(at, lk) if self.right is None else at + self.right + 1
        return np.clip(start, 0, lk), np.clip(stop, 0, lk)

    def hides(self, q0, q1, k0, k1, lq, lk):
        band = self._outer()
        return q0 >= q1 or k0 >= k1 or (band is not None and band.hides(q0, q1, k0, k1))

    def covers(self, q0, q1, k0, k1, lq, lk):
        if self.summary is None:
            return False
        low, high = self.summary
        inner = Band(None if self.left is None else high - self.left,
                     None if self.right is None else low + self.right)
        return inner.covers(q0, q1, k0, k1)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        offset = column(xp, self.key_lengths - self.query_lengths) + self.shift
        rows = along(xp, xp.arange(q0, q1, device=device), offset.ndim, -2)
        cols = along(xp, xp.arange(k0, k1, device=device), offset.ndim, -1)
        diff = cols - rows
        allowed = None
        if self.left is not None:
            allowed = diff >= offset - self.left
        if self.right is not None:
            upper = diff <= offset + self.right
            allowed = upper if allowed is None else xp.logical_and(allowed, upper)
        if allowed is None:
            allowed = xp.logical_or(diff >= offset, diff < offset)
        return allowed

    def allows(self, xp, b, h, q, k, lq, lk):
        offset = per_batch(xp, self.key_lengths - self.query_lengths, b) + self.shift
        return within(k - q - offset, None if self.left is None else -self.left, self.right)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        # local query i' = i - q0 and key j' = j - k0: j - i = j' - i' + k0 - q0
        return replaced(self, shift=self.shift + q0 - k0, cut=True)

    def __repr__(self) -> str:
        shift = f", shift={self.shift}" if self.shift else ""
        return (f"sequence_window(left={self.left}, right={self.right}{shift}, "
                f"shape={tuple(self.query_lengths.shape)})")
