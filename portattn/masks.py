"""Structured attention masks.

A mask says which (query i, key j) pairs may attend. Masks are small objects, not
L x L arrays, so a kernel can tell from the structure alone which tiles are fully
masked (and skip them) and build a boolean mask for one tile at a time.

Positions: with ``bottom_right`` alignment query ``i`` sits at absolute position
``i + (Lk - Lq)``; with ``top_left`` at ``i``. The two coincide when ``Lq == Lk``.
Masks combine with ``&`` (pairs allowed by every part). Alignment always uses the
array lengths ``Lq`` and ``Lk``, so combining with ``key_lengths`` is a plain
intersection.

Tiles returned by :meth:`Mask.tile` are boolean arrays (True = attend) of shape
``(tq, tk)`` or of full rank ``(*batch, H, tq, tk)`` with broadcastable 1s.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

# check_range and jax_tracer_type are also for plugins that read mask values themselves
from ._mask_values import check_range, dtype_text, jax_tracer_type, signed  # noqa: F401

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "Mask",
    "causal",
    "dense",
    "key_lengths",
    "query_lengths",
    "sliding_window",
]

KINDS = ("causal", "sliding_window", "key_lengths", "query_lengths", "dense")


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


class Mask:
    """Base of every mask; combine masks with ``&``."""

    kind: str = ""

    @property
    def parts(self) -> tuple[Mask, ...]:
        return (self,)

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(p.kind for p in self.parts)

    @property
    def arrays(self) -> tuple[Any, ...]:
        """Arrays held by the mask (for namespace and device checks)."""
        return ()

    def __and__(self, other: Mask) -> Mask:
        if not isinstance(other, Mask):
            return NotImplemented
        return _Intersection(self.parts + other.parts)

    def __iter__(self) -> Iterator[Mask]:
        return iter(self.parts)

    def key(self) -> Any:
        """A plain value equal for equal masks (what ``==`` and ``hash`` compare).

        Built from the parameters alone, so a compiler tracing a mask built inside the
        traced function (torch.compile) can use it before the mask object exists.
        Masks that hold arrays compare by identity."""
        return (type(self), id(self))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mask) and other.key() == self.key()

    def __hash__(self) -> int:
        return hash(self.key())

    # --- static structure, used to skip work -------------------------------------
    def key_range(self, q0: int, q1: int, lq: int, lk: int) -> tuple[int, int]:
        """Half-open range of keys that some query in ``[q0, q1)`` may attend."""
        return 0, lk

    def covers(self, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int) -> bool:
        """True when every pair in the tile is allowed, known without reading data."""
        return False

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
    """Masks defined by query/key positions only (no arrays).

    ``shift`` moves the query positions further; it is how :meth:`restrict` keeps a
    sub-problem aligned with the whole.
    """

    shift: int = 0

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        qpos = xp.arange(q0, q1, device=device)[:, None] + self.offset(lq, lk)
        kpos = xp.arange(k0, k1, device=device)[None, :]
        return self._allowed(xp, qpos, kpos)

    def _base(self, lq: int, lk: int) -> int:
        return lk - lq

    def offset(self, lq: int, lk: int) -> int:
        """Absolute position of query 0 (key ``j`` sits at ``j``) for these lengths."""
        return self._base(lq, lk) + self.shift

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        # global position of local query i: (q0 + i) + offset; of local key j: k0 + j.
        shift = self.offset(lq, lk) + q0 - k0 - self._base(q1 - q0, k1 - k0)
        return self._shifted(shift)

    def _shifted(self, shift: int) -> Mask:
        raise NotImplementedError

    def _shift_text(self) -> str:
        return f", shift={self.shift}" if self.shift else ""

    def _allowed(self, xp, qpos, kpos):
        raise NotImplementedError


class _Causal(_Positional):
    kind = "causal"

    def __init__(self, alignment: str, shift: int = 0) -> None:
        if alignment not in ("bottom_right", "top_left"):
            msg = f"alignment must be 'bottom_right' or 'top_left'; got alignment={alignment!r}"
            raise ValueError(msg)
        self.alignment = alignment
        self.shift = shift

    def _base(self, lq, lk):
        return lk - lq if self.alignment == "bottom_right" else 0

    def _shifted(self, shift):
        return _Causal(self.alignment, shift)

    def key_range(self, q0, q1, lq, lk):
        return 0, max(0, min(lk, q1 + self.offset(lq, lk)))

    def covers(self, q0, q1, k0, k1, lq, lk):
        return k1 - 1 <= q0 + self.offset(lq, lk)

    def _allowed(self, xp, qpos, kpos):
        return kpos <= qpos

    def __repr__(self) -> str:
        return f"causal({self.alignment}{self._shift_text()})"

    def key(self) -> tuple:
        return ("causal", self.alignment, self.shift)


class _SlidingWindow(_Positional):
    kind = "sliding_window"

    def __init__(self, left: int | None, right: int | None, shift: int = 0) -> None:
        for name, value in (("left", left), ("right", right)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                msg = f"sliding_window {name} must be an int >= 0 or None; got {name}={value!r}"
                raise ValueError(msg)
        self.left = left
        self.right = right
        self.shift = shift

    def _shifted(self, shift):
        return _SlidingWindow(self.left, self.right, shift)

    def _bounds(self) -> tuple[float, float]:
        left = math.inf if self.left is None else self.left
        right = math.inf if self.right is None else self.right
        return left, right

    def key_range(self, q0, q1, lq, lk):
        left, right = self._bounds()
        off = self.offset(lq, lk)
        lo = 0 if left == math.inf else max(0, q0 + off - left)
        hi = lk if right == math.inf else min(lk, q1 - 1 + off + right + 1)
        return int(min(lo, lk)), int(max(hi, 0))

    def covers(self, q0, q1, k0, k1, lq, lk):
        left, right = self._bounds()
        off = self.offset(lq, lk)
        return k0 >= q1 - 1 + off - left and k1 - 1 <= q0 + off + right

    def _allowed(self, xp, qpos, kpos):
        allowed = None
        if self.left is not None:
            allowed = kpos >= qpos - self.left
        if self.right is not None:
            upper = kpos <= qpos + self.right
            allowed = upper if allowed is None else xp.logical_and(allowed, upper)
        if allowed is None:  # unbounded both ways: every pair
            allowed = xp.logical_or(kpos >= 0, qpos >= 0)
        return allowed

    def __repr__(self) -> str:
        return f"sliding_window(left={self.left}, right={self.right}{self._shift_text()})"

    def key(self) -> tuple:
        return ("sliding_window", self.left, self.right, self.shift)


class _Lengths(Mask):
    """Per-batch valid lengths (right padding) of the keys or the queries."""

    def __init__(self, lengths: Any) -> None:
        if not hasattr(lengths, "shape") or not hasattr(lengths, "dtype"):
            msg = (f"{self.kind} expects an integer array with the batch shape; "
                   f"got {type(lengths).__name__}")
            raise TypeError(msg)
        self.lengths = lengths

    @property
    def arrays(self):
        return (self.lengths,)

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
        return self if lengths is self.lengths else type(self)(lengths)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        start, stop = (k0, k1) if self.kind == "key_lengths" else (q0, q1)
        # signed first: lengths - start must not wrap around in an unsigned dtype
        # (asarray: NumPy's clip turns a 0-d array into a scalar)
        return type(self)(xp.asarray(xp.clip(signed(xp, self.lengths) - start, 0, stop - start)))

    def _column(self, xp):
        # (*batch) -> (*batch, 1, 1, 1): broadcasts against (*batch, H, tq, tk)
        return xp.reshape(self.lengths, (*self.lengths.shape, 1, 1, 1))

    def __repr__(self) -> str:
        return f"{self.kind}(shape={tuple(self.lengths.shape)})"


class _KeyLengths(_Lengths):
    kind = "key_lengths"

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return xp.arange(k0, k1, device=device) < self._column(xp)


class _QueryLengths(_Lengths):
    kind = "query_lengths"

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return xp.arange(q0, q1, device=device)[:, None] < self._column(xp)


class _Dense(Mask):
    kind = "dense"

    def __init__(self, allowed: Any) -> None:
        if not hasattr(allowed, "shape") or not hasattr(allowed, "dtype"):
            msg = f"dense expects a boolean array; got {type(allowed).__name__}"
            raise TypeError(msg)
        self.allowed = allowed

    @property
    def arrays(self):
        return (self.allowed,)

    def bind(self, xp, batch_shape, num_heads, lq, lk):
        if not xp.isdtype(self.allowed.dtype, "bool"):
            msg = ("dense mask must have dtype bool (True = attend); got "
                   f"dense.dtype={dtype_text(self.allowed.dtype)}")
            raise TypeError(msg)
        full = expand_to_rank(xp, self.allowed, (*batch_shape, num_heads, lq, lk), "dense mask")
        return _Dense(full)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return slice_tile(self.allowed, q0, q1, k0, k1)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return _Dense(slice_tile(self.allowed, q0, q1, k0, k1))

    def __repr__(self) -> str:
        return f"dense(shape={tuple(self.allowed.shape)})"


class _Intersection(Mask):
    def __init__(self, parts: tuple[Mask, ...]) -> None:
        self._parts = parts

    @property
    def parts(self):
        return self._parts

    @property
    def arrays(self):
        return tuple(a for p in self._parts for a in p.arrays)

    def key_range(self, q0, q1, lq, lk):
        lo, hi = 0, lk
        for p in self._parts:
            plo, phi = p.key_range(q0, q1, lq, lk)
            lo, hi = max(lo, plo), min(hi, phi)
        return lo, hi

    def covers(self, q0, q1, k0, k1, lq, lk):
        return all(p.covers(q0, q1, k0, k1, lq, lk) for p in self._parts)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        allowed = None
        for p in self._parts:
            if p.covers(q0, q1, k0, k1, lq, lk):
                continue
            t = p.tile(xp, q0, q1, k0, k1, lq, lk, device)
            allowed = t if allowed is None else xp.logical_and(allowed, t)
        return allowed

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return _Intersection(tuple(p.restrict(xp, q0, q1, k0, k1, lq, lk) for p in self._parts))

    def bind(self, xp, batch_shape, num_heads, lq, lk):
        return _Intersection(tuple(p.bind(xp, batch_shape, num_heads, lq, lk)
                                   for p in self._parts))

    def __repr__(self) -> str:
        return " & ".join(repr(p) for p in self._parts)

    def key(self) -> tuple:
        return tuple(p.key() for p in self._parts)


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
    """Rows ``q0:q1`` and columns ``k0:k1`` of a full-rank array, keeping 1-sized axes."""
    rows = slice(None) if array.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if array.shape[-1] == 1 else slice(k0, k1)
    return array[..., rows, cols]


def causal(alignment: str = "bottom_right") -> Mask:
    """Query at position ``p`` attends keys ``j <= p`` (see module doc for alignment)."""
    _before_creating()
    return _Causal(alignment)


def sliding_window(left: int | None, right: int | None = 0) -> Mask:
    """Query at (bottom-right aligned) position ``p`` attends ``p-left <= j <= p+right``.

    Both ends are inclusive; ``None`` leaves that side unbounded, so
    ``sliding_window(None, 0)`` equals ``causal()``.
    """
    _before_creating()
    return _SlidingWindow(left, right)


def key_lengths(lengths: Any) -> Mask:
    """Keys ``j >= lengths[b]`` of batch element ``b`` are padding."""
    _before_creating()
    return _KeyLengths(lengths)


def query_lengths(lengths: Any) -> Mask:
    """Queries ``i >= lengths[b]`` are padding: their rows are fully masked (output 0)."""
    _before_creating()
    return _QueryLengths(lengths)


def dense(allowed: Any) -> Mask:
    """An explicit boolean mask (True = attend), broadcastable to ``(..., Hq, Lq, Lk)``."""
    _before_creating()
    return _Dense(allowed)
