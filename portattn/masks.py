"""Structured attention masks: a public protocol every kernel reads.

A mask says which (query i, key j) pairs may attend. Masks are small frozen objects,
not L x L arrays, so a kernel can tell from the structure alone which tiles are
fully hidden (and skip them) and build a boolean mask for one tile at a time.

Positions: with ``bottom_right`` alignment query ``i`` sits at absolute position
``i + (Lk - Lq)``; with ``top_left`` at ``i``. The two coincide when ``Lq == Lk``.
Masks combine with ``&`` (pairs allowed by every part). ``causal`` and
``sliding_window`` are aligned to the array lengths ``Lq`` and ``Lk``, so combining them
with ``key_lengths`` is a plain intersection; :func:`sequence_causal` and
:func:`sequence_window` align to each sequence's own lengths instead (flash-attn's
varlen convention).

What a kernel may ask, for a call of ``Lq`` queries and ``Lk`` keys:

- :attr:`Mask.parts` and :attr:`Mask.kinds`: the public kinds below, with their
  parameters as attributes (:class:`Causal`, :class:`SlidingWindow`,
  :class:`KeyLengths`, :class:`QueryLengths`, :class:`Dense`, and for real batches
  :class:`KeyRanges`, :class:`QueryRanges`, :class:`SequenceWindow`,
  :class:`Documents`);
- :meth:`Mask.band`: every causal and sliding-window part folded into one
  :class:`Band` (``lower <= j - i <= upper`` for query row ``i``, key ``j``);
- :meth:`Mask.parts_of`: the parts of one kind, e.g. the length arrays;
- :meth:`Mask.key_range`, :meth:`Mask.covers`, :meth:`Mask.hides`: what a tile needs,
  known without reading data; :meth:`Mask.tile`: the boolean tile itself;
- :attr:`Mask.arrays` and :meth:`Mask.with_arrays`: the arrays inside, and the same
  mask holding other ones (pytrees, device moves, borrowing into another library);
- :meth:`Mask.restrict`: the mask of a sub-problem (split-KV, ring attention).

Tiles are boolean arrays (True = attend) of shape ``(tq, tk)`` or of full rank
``(*batch, H, tq, tk)`` with broadcastable 1s.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

# check_range and jax_tracer_type are also for plugins that read mask values themselves
from ._mask_values import check_range, dtype_text, jax_tracer_type, signed  # noqa: F401

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

__all__ = [
    "Band",
    "Causal",
    "Dense",
    "Documents",
    "Intersection",
    "KeyLengths",
    "KeyRanges",
    "Mask",
    "QueryLengths",
    "QueryRanges",
    "SequenceWindow",
    "SlidingWindow",
    "causal",
    "check_range",
    "dense",
    "documents",
    "documents_from_cu_seqlens",
    "key_lengths",
    "key_ranges",
    "on_mask_created",
    "query_lengths",
    "query_ranges",
    "sequence_causal",
    "sequence_window",
    "slice_tile",
    "sliding_window",
]

KINDS = ("causal", "sliding_window", "key_lengths", "query_lengths", "dense", "key_ranges",
         "query_ranges", "sequence_window", "documents")
"""The kinds a kernel may declare in ``Kernel.masks``."""

POSITIONAL = frozenset({"causal", "sliding_window"})
"""Kinds defined by positions alone: :meth:`Mask.band` describes them completely."""


_creation_hooks: list[Callable[[], bool]] = []


def on_mask_created(hook: Callable[[], bool]) -> None:
    """For plugins: call ``hook()`` whenever a mask is built, until it returns True.

    JAX needs masks registered as pytrees before one is passed to a jitted function,
    and a plugin may be loaded before JAX is imported: its hook registers them on the
    first mask built once JAX is there. A hook never imports a library itself.
    """
    _creation_hooks.append(hook)


def _before_creating() -> None:
    """Run the creation hooks (the public constructors call this first: a compiler
    that stops tracing inside a hook then never holds a half-built mask)."""
    for hook in list(_creation_hooks):
        if hook():
            _creation_hooks.remove(hook)


@dataclass(frozen=True)
class Band:
    """Key ``j`` is allowed for query row ``i`` iff ``lower <= j - i <= upper``.

    Rows and keys are array indices (``0 <= i < Lq``, ``0 <= j < Lk``); alignment and
    any shift are already folded in. ``None`` leaves a side unbounded. Top-left causal
    is ``Band(None, 0)``; bottom-right causal is ``Band(None, Lk - Lq)``.
    """

    lower: int | None = None
    upper: int | None = None

    def __and__(self, other: Band) -> Band:
        return Band(_max(self.lower, other.lower), _min(self.upper, other.upper))

    def normalized(self, lq: int, lk: int) -> Band:
        """The same set of pairs, with bounds that exclude nothing made ``None``."""
        lower = None if self.lower is not None and self.lower <= -(lq - 1) else self.lower
        upper = None if self.upper is not None and self.upper >= lk - 1 else self.upper
        return Band(lower, upper)

    def key_range(self, q0: int, q1: int, lk: int) -> tuple[int, int]:
        """Half-open range of keys that some row in ``[q0, q1)`` may attend."""
        lo = 0 if self.lower is None else q0 + self.lower
        hi = lk if self.upper is None else q1 + self.upper
        return min(max(lo, 0), lk), max(min(hi, lk), 0)

    def covers(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Every pair of the tile is allowed."""
        return ((self.lower is None or k0 - (q1 - 1) >= self.lower)
                and (self.upper is None or (k1 - 1) - q0 <= self.upper))

    def hides(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """No pair of the tile is allowed."""
        if q0 >= q1 or k0 >= k1:
            return True
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            return True
        return ((self.upper is not None and k0 - (q1 - 1) > self.upper)
                or (self.lower is not None and (k1 - 1) - q0 < self.lower))

    def tile(self, xp: Any, q0: int, q1: int, k0: int, k1: int, device: Any = None) -> Any:
        """Boolean ``(q1 - q0, k1 - k0)`` array, True where the pair is allowed."""
        rows = xp.arange(q0, q1, device=device)[:, None]
        cols = xp.arange(k0, k1, device=device)[None, :]
        diff = cols - rows
        allowed = None
        if self.lower is not None:
            allowed = diff >= self.lower
        if self.upper is not None:
            upper = diff <= self.upper
            allowed = upper if allowed is None else xp.logical_and(allowed, upper)
        if allowed is None:  # unbounded both ways: every pair
            allowed = xp.logical_or(diff >= 0, diff < 0)
        return allowed


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _min(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


class Mask:
    """Base of every mask; combine masks with ``&``. Defaults describe a part that
    allows every pair as far as the structure tells (subclasses narrow them)."""

    kind: ClassVar[str] = ""

    @property
    def parts(self) -> tuple[Mask, ...]:
        """The masks this one intersects (itself for a single kind)."""
        return (self,)

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(p.kind for p in self.parts)

    def parts_of(self, kind: str) -> tuple[Mask, ...]:
        """The parts of one kind, e.g. ``[p.lengths for p in m.parts_of("key_lengths")]``."""
        return tuple(p for p in self.parts if p.kind == kind)

    @property
    def arrays(self) -> tuple[Any, ...]:
        """The arrays held by the mask, in a fixed order (see :meth:`with_arrays`)."""
        return ()

    def with_arrays(self, arrays: Sequence[Any]) -> Mask:
        """The same mask holding ``arrays`` (as many as :attr:`arrays`, same order)
        instead. Nothing is checked: it is for moving arrays (pytrees, devices,
        DLPack), not for building masks from user input."""
        if len(arrays):
            msg = f"{self!r} holds no arrays; got {len(arrays)}"
            raise ValueError(msg)
        return self

    def structure(self) -> tuple:
        """A hashable value equal for masks that differ at most in their arrays."""
        return (self.kind,)

    def key(self) -> Any:
        """A plain value equal for equal masks (what ``==`` and ``hash`` compare).

        Built from the parameters alone, so a compiler tracing a mask built inside the
        traced function (torch.compile) can use it before the mask object exists.
        Masks that hold arrays compare by the arrays' identity."""
        return (self.structure(), tuple(id(a) for a in self.arrays))

    def __and__(self, other: Mask) -> Mask:
        if not isinstance(other, Mask):
            return NotImplemented
        return Intersection(self.parts + other.parts)

    def __iter__(self) -> Iterator[Mask]:
        return iter(self.parts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mask) and other.key() == self.key()

    def __hash__(self) -> int:
        return hash(self.key())

    # --- static structure: what a tile needs, known without reading data --------------
    def band(self, lq: int, lk: int) -> Band | None:
        """The positional parts folded into one band; None when there are none."""
        return None

    def key_range(self, q0: int, q1: int, lq: int, lk: int) -> tuple[int, int]:
        """Half-open range of keys that some query in ``[q0, q1)`` may attend."""
        return 0, lk

    def covers(self, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int) -> bool:
        """True when every pair in the tile is allowed, known without reading data."""
        return False

    def hides(self, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int) -> bool:
        """True when no pair in the tile is allowed, known without reading data."""
        return q0 >= q1 or k0 >= k1

    def tile(self, xp: Any, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int,
             device: Any = None) -> Any:
        """Boolean array for the tile (True = attend)."""
        raise NotImplementedError

    def bind(self, xp: Any, batch_shape: tuple[int, ...], num_heads: int, lq: int,
             lk: int) -> Mask:
        """Validate against a call's shapes; return the mask normalised for it."""
        return self

    def restrict(self, xp: Any, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int) -> Mask:
        """The mask of the sub-problem ``query[q0:q1]`` x ``key[k0:k1]``, in its own
        coordinates (for split-KV, ring attention and blockwise schedulers)."""
        raise NotImplementedError


class _Positional(Mask):
    """Masks defined by query/key positions only: everything follows from the band.

    ``shift`` moves the query positions further; it is how :meth:`restrict` keeps a
    sub-problem aligned with the whole.
    """

    shift: int

    def offset(self, lq: int, lk: int) -> int:
        """Absolute position of query 0 (key ``j`` sits at ``j``) for these lengths."""
        return self._base(lq, lk) + self.shift

    def _base(self, lq: int, lk: int) -> int:
        return lk - lq

    def band(self, lq, lk):
        raise NotImplementedError

    def key_range(self, q0, q1, lq, lk):
        return self.band(lq, lk).key_range(q0, q1, lk)

    def covers(self, q0, q1, k0, k1, lq, lk):
        return self.band(lq, lk).covers(q0, q1, k0, k1)

    def hides(self, q0, q1, k0, k1, lq, lk):
        return self.band(lq, lk).hides(q0, q1, k0, k1)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return self.band(lq, lk).tile(xp, q0, q1, k0, k1, device)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        # global position of local query i: (q0 + i) + offset; of local key j: k0 + j.
        shift = self.offset(lq, lk) + q0 - k0 - self._base(q1 - q0, k1 - k0)
        return _replaced(self, shift=shift)

    def structure(self) -> tuple:
        return (self.kind, *(getattr(self, f.name) for f in fields(self)))

    def key(self) -> tuple:
        return self.structure()

    def _shift_text(self) -> str:
        return f", shift={self.shift}" if self.shift else ""


@dataclass(frozen=True, eq=False, repr=False)
class Causal(_Positional):
    """Query at absolute position ``p`` attends keys ``j <= p``."""

    kind: ClassVar[str] = "causal"
    alignment: str = "bottom_right"
    shift: int = 0

    def __post_init__(self) -> None:
        if self.alignment not in ("bottom_right", "top_left"):
            msg = ("alignment must be 'bottom_right' or 'top_left'; got "
                   f"alignment={self.alignment!r}")
            raise ValueError(msg)

    def _base(self, lq, lk):
        return lk - lq if self.alignment == "bottom_right" else 0

    def band(self, lq, lk):
        return Band(None, self.offset(lq, lk))

    def __repr__(self) -> str:
        return f"causal({self.alignment}{self._shift_text()})"


@dataclass(frozen=True, eq=False, repr=False)
class SlidingWindow(_Positional):
    """Query at (bottom-right aligned) position ``p`` attends ``p-left <= j <= p+right``."""

    kind: ClassVar[str] = "sliding_window"
    left: int | None
    right: int | None = 0
    shift: int = 0

    def __post_init__(self) -> None:
        for name in ("left", "right"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                msg = f"sliding_window {name} must be an int >= 0 or None; got {name}={value!r}"
                raise ValueError(msg)

    def band(self, lq, lk):
        offset = self.offset(lq, lk)
        return Band(None if self.left is None else offset - self.left,
                    None if self.right is None else offset + self.right)

    def __repr__(self) -> str:
        return f"sliding_window(left={self.left}, right={self.right}{self._shift_text()})"


class _Lengths(Mask):
    """Per-batch valid lengths (right padding) of the keys or the queries."""

    lengths: Any

    def __post_init__(self) -> None:
        if not hasattr(self.lengths, "shape") or not hasattr(self.lengths, "dtype"):
            msg = (f"{self.kind} expects an integer array with the batch shape; "
                   f"got {type(self.lengths).__name__}")
            raise TypeError(msg)

    @property
    def arrays(self):
        return (self.lengths,)

    def with_arrays(self, arrays):
        (lengths,) = arrays
        return _replaced(self, lengths=lengths)

    def bind(self, xp, batch_shape, num_heads, lq, lk):
        lengths = self.lengths
        if not xp.isdtype(lengths.dtype, "integral"):
            msg = (f"{self.kind} lengths must have an integer dtype; got "
                   f"{self.kind}.dtype={dtype_text(lengths.dtype)}")
            raise TypeError(msg)
        if tuple(lengths.shape) != tuple(batch_shape):
            msg = (f"{self.kind} lengths must have the batch shape of query, "
                   f"{tuple(batch_shape)}; got lengths.shape={tuple(lengths.shape)}")
            raise ValueError(msg)
        limit = lk if self.kind == "key_lengths" else lq
        lengths = signed(xp, lengths)
        check_range(xp, lengths, limit, self.kind)
        return self if lengths is self.lengths else _replaced(self, lengths=lengths)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        start, stop = (k0, k1) if self.kind == "key_lengths" else (q0, q1)
        # signed first: lengths - start must not wrap around in an unsigned dtype
        # (asarray: NumPy's clip turns a 0-d array into a scalar)
        lengths = xp.asarray(xp.clip(signed(xp, self.lengths) - start, 0, stop - start))
        return _replaced(self, lengths=lengths)

    def column(self, xp: Any) -> Any:
        """The lengths as ``(*batch, 1, 1, 1)``: broadcasts against ``(*batch, H, tq, tk)``."""
        return xp.reshape(self.lengths, (*self.lengths.shape, 1, 1, 1))

    def __repr__(self) -> str:
        return f"{self.kind}(shape={tuple(self.lengths.shape)})"


@dataclass(frozen=True, eq=False, repr=False)
class KeyLengths(_Lengths):
    """Keys ``j >= lengths[b]`` of batch element ``b`` are padding."""

    kind: ClassVar[str] = "key_lengths"
    lengths: Any

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return xp.arange(k0, k1, device=device) < self.column(xp)


@dataclass(frozen=True, eq=False, repr=False)
class QueryLengths(_Lengths):
    """Queries ``i >= lengths[b]`` are padding: their rows are fully masked."""

    kind: ClassVar[str] = "query_lengths"
    lengths: Any

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return xp.arange(q0, q1, device=device)[:, None] < self.column(xp)


@dataclass(frozen=True, eq=False, repr=False)
class Dense(Mask):
    """An explicit boolean array (True = attend); full rank once bound to a call."""

    kind: ClassVar[str] = "dense"
    allowed: Any

    def __post_init__(self) -> None:
        if not hasattr(self.allowed, "shape") or not hasattr(self.allowed, "dtype"):
            msg = f"dense expects a boolean array; got {type(self.allowed).__name__}"
            raise TypeError(msg)

    @property
    def arrays(self):
        return (self.allowed,)

    def with_arrays(self, arrays):
        (allowed,) = arrays
        return _replaced(self, allowed=allowed)

    def bind(self, xp, batch_shape, num_heads, lq, lk):
        if not xp.isdtype(self.allowed.dtype, "bool"):
            msg = ("dense mask must have dtype bool (True = attend); got "
                   f"dense.dtype={dtype_text(self.allowed.dtype)}")
            raise TypeError(msg)
        full = expand_to_rank(xp, self.allowed, (*batch_shape, num_heads, lq, lk), "dense mask")
        return _replaced(self, allowed=full)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return slice_tile(self.allowed, q0, q1, k0, k1)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return _replaced(self, allowed=slice_tile(self.allowed, q0, q1, k0, k1))

    def __repr__(self) -> str:
        return f"dense(shape={tuple(self.allowed.shape)})"


@dataclass(frozen=True, eq=False, repr=False)
class Intersection(Mask):
    """Pairs allowed by every one of ``parts`` (what ``a & b`` builds)."""

    members: tuple[Mask, ...]

    @property
    def parts(self):
        return self.members

    @property
    def arrays(self):
        return tuple(a for p in self.members for a in p.arrays)

    def with_arrays(self, arrays):
        if len(arrays) != len(self.arrays):
            msg = f"{self!r} holds {len(self.arrays)} arrays; got {len(arrays)}"
            raise ValueError(msg)
        rest, parts = list(arrays), []
        for p in self.members:
            n = len(p.arrays)
            parts.append(p.with_arrays(rest[:n]))
            del rest[:n]
        return Intersection(tuple(parts))

    def structure(self):
        return tuple(p.structure() for p in self.members)

    def band(self, lq, lk):
        bands = [p.band(lq, lk) for p in self.members if p.kind in POSITIONAL]
        if not bands:
            return None
        band = bands[0]
        for b in bands[1:]:
            band = band & b
        return band

    def key_range(self, q0, q1, lq, lk):
        lo, hi = 0, lk
        for p in self.members:
            plo, phi = p.key_range(q0, q1, lq, lk)
            lo, hi = max(lo, plo), min(hi, phi)
        return lo, hi

    def covers(self, q0, q1, k0, k1, lq, lk):
        return all(p.covers(q0, q1, k0, k1, lq, lk) for p in self.members)

    def hides(self, q0, q1, k0, k1, lq, lk):
        # The positional parts as one band (two windows may hide a tile that neither
        # hides alone), the others one by one.
        band = self.band(lq, lk)
        return ((band is not None and band.hides(q0, q1, k0, k1))
                or any(p.hides(q0, q1, k0, k1, lq, lk) for p in self.members
                       if p.kind not in POSITIONAL))

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        allowed = None
        for p in self.members:
            if p.covers(q0, q1, k0, k1, lq, lk):
                continue
            t = p.tile(xp, q0, q1, k0, k1, lq, lk, device)
            allowed = t if allowed is None else xp.logical_and(allowed, t)
        return allowed

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return Intersection(tuple(p.restrict(xp, q0, q1, k0, k1, lq, lk)
                                  for p in self.members))

    def bind(self, xp, batch_shape, num_heads, lq, lk):
        return Intersection(tuple(p.bind(xp, batch_shape, num_heads, lq, lk)
                                  for p in self.members))

    def __repr__(self) -> str:
        return " & ".join(repr(p) for p in self.members)

    def key(self) -> tuple:
        return tuple(p.key() for p in self.members)


def _replaced(mask: Mask, **changes: Any) -> Mask:
    """A copy of a frozen mask with some fields changed, without re-running the
    checks of its constructor (the values come from a mask that passed them, or are
    arrays being moved: tracers, placeholders)."""
    copy = object.__new__(type(mask))
    for f in fields(mask):
        object.__setattr__(copy, f.name, changes.get(f.name, getattr(mask, f.name)))
    return copy


def expand_to_rank(xp: Any, array: Any, target: tuple[int, ...], what: str) -> Any:
    """Check ``array`` broadcasts to ``target``; prepend 1s to reach its rank."""
    shape = tuple(array.shape)
    ok = len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(shape[::-1], target[::-1], strict=False))
    if not ok:
        msg = (f"{what} of shape {shape} does not broadcast to "
               f"(*batch, Hq, Lq, Lk) = {target}")
        raise ValueError(msg)
    return xp.reshape(array, (1,) * (len(target) - len(shape)) + shape)


def slice_tile(array: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
    """Rows ``q0:q1`` and columns ``k0:k1`` of a full-rank array (a bound dense mask, a
    bias), keeping its 1-sized (broadcast) axes as they are."""
    rows = slice(None) if array.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if array.shape[-1] == 1 else slice(k0, k1)
    return array[..., rows, cols]


def causal(alignment: str = "bottom_right") -> Causal:
    """Query at position ``p`` attends keys ``j <= p`` (see module doc for alignment)."""
    _before_creating()
    return Causal(alignment)


def sliding_window(left: int | None, right: int | None = 0) -> SlidingWindow:
    """Query at (bottom-right aligned) position ``p`` attends ``p-left <= j <= p+right``.

    Both ends are inclusive; ``None`` leaves that side unbounded, so
    ``sliding_window(None, 0)`` equals ``causal()``.
    """
    _before_creating()
    return SlidingWindow(left, right)


def key_lengths(lengths: Any) -> KeyLengths:
    """Keys ``j >= lengths[b]`` of batch element ``b`` are padding."""
    _before_creating()
    return KeyLengths(lengths)


def query_lengths(lengths: Any) -> QueryLengths:
    """Queries ``i >= lengths[b]`` are padding: their rows are fully masked (output 0)."""
    _before_creating()
    return QueryLengths(lengths)


def dense(allowed: Any) -> Dense:
    """An explicit boolean mask (True = attend), broadcastable to ``(..., Hq, Lq, Lk)``."""
    _before_creating()
    return Dense(allowed)


# Kinds for real batches (padding on either side, per-sequence alignment, packed
# documents) live in their own modules; they subclass Mask, defined above.
from ._documents import Documents, ids_from_cu_seqlens  # noqa: E402
from ._ranges import KeyRanges, QueryRanges, SequenceWindow  # noqa: E402


def key_ranges(start: Any, stop: Any) -> KeyRanges:
    """Batch element ``b`` attends keys ``start[b] <= j < stop[b]`` only (left padding:
    ``start`` = number of pad tokens, ``stop`` = ``Lk``). Integer arrays with the batch
    shape, values in ``[0, Lk]``."""
    _before_creating()
    return KeyRanges(start, stop)


def query_ranges(start: Any, stop: Any) -> QueryRanges:
    """Queries outside ``start[b] <= i < stop[b]`` are padding: their rows are fully
    masked (output 0)."""
    _before_creating()
    return QueryRanges(start, stop)


def sequence_window(left: int | None, right: int | None = 0, *, query_lengths: Any,
                    key_lengths: Any) -> Mask:
    """A sliding window aligned to each sequence's own lengths (flash-attn's varlen).

    Query ``i`` of batch element ``b`` sits at ``p = i + key_lengths[b] -
    query_lengths[b]`` and attends ``p - left <= j <= p + right``; queries
    ``i >= query_lengths[b]`` and keys ``j >= key_lengths[b]`` are padding. With equal
    lengths everywhere this is :func:`sliding_window` and :func:`key_lengths`.
    """
    _before_creating()
    return Intersection((SequenceWindow(query_lengths, key_lengths, left, right),
                         QueryLengths(query_lengths), KeyLengths(key_lengths)))


def sequence_causal(query_lengths: Any, key_lengths: Any) -> Mask:
    """Causal attention aligned to each sequence's own lengths (flash-attn's varlen
    ``causal=True``): ``sequence_window(None, 0, ...)``. Decoding a batch of caches of
    different lengths is ``sequence_causal(ones, cache_lengths)``."""
    return sequence_window(None, 0, query_lengths=query_lengths, key_lengths=key_lengths)


def documents(segment_ids: Any, key_segment_ids: Any = None) -> Documents:
    """Packed sequences: query ``i`` attends key ``j`` only when their segment ids are
    equal; negative ids are padding and attend nothing.

    ``segment_ids`` is ``(*batch, Lq)`` or ``(Lq,)``; ``key_segment_ids`` (default: the
    same array, for ``Lq == Lk``) is ``(*batch, Lk)`` or ``(Lk,)``. Combine with
    ``causal()`` for causal packed training.
    """
    _before_creating()
    return Documents(segment_ids, segment_ids if key_segment_ids is None else key_segment_ids)


def documents_from_cu_seqlens(cu_seqlens: Any, length: int) -> Documents:
    """:func:`documents` from cumulative lengths ``(*batch, n + 1)`` or ``(n + 1,)``
    (flash-attn's ``cu_seqlens``): document ``d`` holds positions
    ``cu_seqlens[d] <= j < cu_seqlens[d + 1]`` of a row of ``length`` tokens; positions
    past the last document are padding."""
    _before_creating()
    ids = ids_from_cu_seqlens(cu_seqlens, length)
    return Documents(ids, ids)
