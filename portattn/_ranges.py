"""Masks whose extent differs per sequence: key/query ranges and per-sequence windows.

- :class:`KeyRanges` / :class:`QueryRanges`: batch element ``b`` keeps keys (queries)
  ``start[b] <= j < stop[b]``: left and right padding at once.
- :class:`SequenceWindow`: causal and sliding windows aligned to each sequence's own
  lengths, flash-attn's varlen convention: query ``i`` of ``b`` sits at position
  ``i + key_lengths[b] - query_lengths[b]`` (batched decoding with caches of
  different lengths needs exactly this).

Their tiles depend on array values. When a mask is bound to a call whose arrays can
be read (see :mod:`portattn._host_values`) it keeps their extremes as a ``summary``,
from which :meth:`key_range`, :meth:`hides` and :meth:`covers` tell the kernels which
tiles to skip; without one (traced or lazy arrays) every tile is visited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._host_values import host_copy
from ._mask_values import dtype_text, signed, values_readable
from .masks import Band, Mask, _replaced

__all__ = ["KeyRanges", "QueryRanges", "SequenceWindow", "check_integer_array"]


def check_integer_array(xp: Any, a: Any, name: str, shape: tuple[int, ...]) -> Any:
    """``a`` checked to be integral with ``shape``; returned in a signed dtype."""
    if not xp.isdtype(a.dtype, "integral"):
        msg = f"{name} must have an integer dtype; got {name}.dtype={dtype_text(a.dtype)}"
        raise TypeError(msg)
    if tuple(a.shape) != tuple(shape):
        msg = f"{name} must have shape {tuple(shape)}; got {name}.shape={tuple(a.shape)}"
        raise ValueError(msg)
    return signed(xp, a)


def check_bounds(xp: Any, a: Any, limit: int, name: str, limit_name: str) -> None:
    """Values of ``a`` must lie in ``[0, limit]``, checked wherever they can be read."""
    if 0 in tuple(a.shape) or not values_readable(a):
        return
    try:
        bad = bool(xp.any(xp.logical_or(a < 0, a > limit)))
    except Exception:  # values that exist only while tracing
        return
    if bad:
        low, high = int(xp.min(a)), int(xp.max(a))
        msg = (f"{name} must lie in [0, {limit_name}={limit}]; "
               f"got {name} with min={low}, max={high}")
        raise ValueError(msg)


def _column(xp: Any, a: Any) -> Any:
    """``(*batch) -> (*batch, 1, 1, 1)``: broadcasts against ``(*batch, H, tq, tk)``."""
    return xp.reshape(a, (*a.shape, 1, 1, 1))


class _Ranges(Mask):
    """``start[b] <= index < stop[b]`` along the keys or the queries."""

    start: Any
    stop: Any
    summary: tuple[int, int, int, int] | None
    """``(min start, max start, min stop, max stop)``, when the values were read."""

    def __post_init__(self) -> None:
        for name in ("start", "stop"):
            a = getattr(self, name)
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                msg = (f"{self.kind} expects integer arrays with the batch shape; got "
                       f"{name} of type {type(a).__name__}")
                raise TypeError(msg)

    @property
    def _limit_name(self) -> str:
        return "Lk" if self.kind == "key_ranges" else "Lq"

    @property
    def arrays(self):
        return (self.start, self.stop)

    def with_arrays(self, arrays):
        start, stop = arrays
        # other arrays may hold other values: the summary of these ones is dropped
        return _replaced(self, start=start, stop=stop, summary=None)

    def bind(self, xp, batch_shape, num_heads, lq, lk):
        limit = lk if self.kind == "key_ranges" else lq
        start = check_integer_array(xp, self.start, f"{self.kind} start", batch_shape)
        stop = check_integer_array(xp, self.stop, f"{self.kind} stop", batch_shape)
        for name, a in (("start", start), ("stop", stop)):
            check_bounds(xp, a, limit, f"{self.kind} {name}", self._limit_name)
        return _replaced(self, start=start, stop=stop, summary=_summary(start, stop))

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

    def _inside(self, xp: Any, lo: int, hi: int, device: Any) -> Any:
        index = xp.arange(lo, hi, device=device)
        start, stop = _column(xp, self.start), _column(xp, self.stop)
        return xp.logical_and(start <= index, index < stop)

    def _restricted(self, xp: Any, lo: int, hi: int) -> Mask:
        def cut(a):  # asarray: NumPy's clip turns a 0-d array into a scalar
            return xp.asarray(xp.clip(a - lo, 0, hi - lo))

        summary = None if self.summary is None else tuple(
            min(max(v - lo, 0), hi - lo) for v in self.summary)
        return _replaced(self, start=cut(self.start), stop=cut(self.stop), summary=summary)

    def __repr__(self) -> str:
        return f"{self.kind}(shape={tuple(self.start.shape)})"


def _summary(start: Any, stop: Any) -> tuple[int, int, int, int] | None:
    start_h, stop_h = host_copy(start), host_copy(stop)
    if start_h is None or stop_h is None or start_h.size == 0:
        return None
    return (int(start_h.min()), int(start_h.max()), int(stop_h.min()), int(stop_h.max()))


@dataclass(frozen=True, eq=False, repr=False)
class KeyRanges(_Ranges):
    """Batch element ``b`` attends keys ``start[b] <= j < stop[b]`` only."""

    kind: ClassVar[str] = "key_ranges"
    start: Any
    stop: Any
    summary: tuple[int, int, int, int] | None = field(default=None, compare=False)

    def key_range(self, q0, q1, lq, lk):
        return self._span(0, lk)

    def hides(self, q0, q1, k0, k1, lq, lk):
        return q0 >= q1 or self._hidden(k0, k1)

    def covers(self, q0, q1, k0, k1, lq, lk):
        return self._kept(k0, k1)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return self._inside(xp, k0, k1, device)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return self._restricted(xp, k0, k1)


@dataclass(frozen=True, eq=False, repr=False)
class QueryRanges(_Ranges):
    """Queries outside ``start[b] <= i < stop[b]`` are padding: fully masked rows."""

    kind: ClassVar[str] = "query_ranges"
    start: Any
    stop: Any
    summary: tuple[int, int, int, int] | None = field(default=None, compare=False)

    def key_range(self, q0, q1, lq, lk):
        return (0, 0) if self._hidden(q0, q1) else (0, lk)

    def hides(self, q0, q1, k0, k1, lq, lk):
        return k0 >= k1 or self._hidden(q0, q1)

    def covers(self, q0, q1, k0, k1, lq, lk):
        return self._kept(q0, q1)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        rows = self._inside(xp, q0, q1, device)
        return xp.reshape(rows, (*rows.shape[:-2], q1 - q0, 1))

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return self._restricted(xp, q0, q1)


@dataclass(frozen=True, eq=False, repr=False)
class SequenceWindow(Mask):
    """Query ``i`` of batch element ``b`` sits at ``p = i + key_lengths[b] -
    query_lengths[b] (+ shift)`` and attends keys ``p - left <= j <= p + right``
    (``None``: unbounded). ``left=None, right=0`` is causal. Padding is not part of
    it: :func:`portattn.masks.sequence_causal` adds the two length masks."""

    kind: ClassVar[str] = "sequence_window"
    query_lengths: Any
    key_lengths: Any
    left: int | None = None
    right: int | None = 0
    shift: int = 0
    summary: tuple[int, int] | None = field(default=None, compare=False)
    """``(min offset, max offset)`` over the batch, when the lengths were read."""

    def __post_init__(self) -> None:
        for name in ("query_lengths", "key_lengths"):
            a = getattr(self, name)
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                msg = (f"sequence_window expects integer arrays with the batch shape; "
                       f"got {name} of type {type(a).__name__}")
                raise TypeError(msg)
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
        return _replaced(self, query_lengths=query_lengths, key_lengths=key_lengths,
                         summary=None)

    def structure(self) -> tuple:
        return (self.kind, self.left, self.right, self.shift)

    def bind(self, xp, batch_shape, num_heads, lq, lk):
        ql = check_integer_array(xp, self.query_lengths, "sequence_window query_lengths",
                                 batch_shape)
        kl = check_integer_array(xp, self.key_lengths, "sequence_window key_lengths",
                                 batch_shape)
        check_bounds(xp, ql, lq, "sequence_window query_lengths", "Lq")
        check_bounds(xp, kl, lk, "sequence_window key_lengths", "Lk")
        summary = None
        offsets = host_copy(kl - ql)
        if offsets is not None and offsets.size:
            summary = (int(offsets.min()) + self.shift, int(offsets.max()) + self.shift)
        return _replaced(self, query_lengths=ql, key_lengths=kl, summary=summary)

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
        rows = xp.arange(q0, q1, device=device)[:, None]
        cols = xp.arange(k0, k1, device=device)[None, :]
        diff = cols - rows
        offset = _column(xp, self.key_lengths - self.query_lengths) + self.shift
        allowed = None
        if self.left is not None:
            allowed = diff >= offset - self.left
        if self.right is not None:
            upper = diff <= offset + self.right
            allowed = upper if allowed is None else xp.logical_and(allowed, upper)
        if allowed is None:
            allowed = xp.logical_or(diff >= offset, diff < offset)
        return allowed

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        # local query i' = i - q0 and key j' = j - k0: j - i = j' - i' + k0 - q0
        moved = q0 - k0
        summary = None if self.summary is None else tuple(v + moved for v in self.summary)
        return _replaced(self, shift=self.shift + moved, summary=summary)

    def __repr__(self) -> str:
        shift = f", shift={self.shift}" if self.shift else ""
        return (f"sequence_window(left={self.left}, right={self.right}{shift}, "
                f"shape={tuple(self.query_lengths.shape)})")
