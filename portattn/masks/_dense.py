"""Masks given pair by pair: an explicit boolean array (:class:`Dense`) and a mask
function of the indices (:class:`Function`, FlexAttention's ``mask_mod``). Their block
forms are the only ones read from every pair; a function's is remembered across calls
only when it declares the arrays it reads (``args``), by their contents."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from array_api_compat import is_dask_namespace

from .._lib import check_beside, dtype_name, host_copy
from ._base import Mask, expand_to_rank, linear_index, replaced, slice_tile, tile_states
from ._values import array_argument

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._base import Grid

__all__ = ["Dense", "Function"]

#: Pairs evaluated at once while building a function's block form.
CHUNK_PAIRS = 1 << 22


def pair_states(allowed: Any, grid: Grid) -> Any:
    """Tile states of a host boolean array ``(..., rows, keys)`` whose rows and keys
    are those of ``grid``'s tiles (a size-1 axis broadcasts)."""
    import numpy as np

    q0, k0 = int(grid.q_edges[0]), int(grid.k_edges[0])
    shape = (*allowed.shape[:-2], int(grid.q_edges[-1]) - q0, int(grid.k_edges[-1]) - k0)
    allowed = np.broadcast_to(allowed, shape)
    q_edges, k_edges = grid.q_edges[:-1] - q0, grid.k_edges[:-1] - k0
    some = np.logical_or.reduceat(np.logical_or.reduceat(allowed, q_edges, axis=-2),
                                  k_edges, axis=-1)
    every = np.logical_and.reduceat(np.logical_and.reduceat(allowed, q_edges, axis=-2),
                                    k_edges, axis=-1)
    return tile_states(~some, every)


@dataclass(frozen=True, eq=False, repr=False)
class Dense(Mask):
    """An explicit boolean array (True = attend); made by
    :func:`~portattn.masks.dense`, and what a boolean ``mask=`` array becomes.

    ``allowed`` broadcasts to ``(*batch, Hq, Lq, Lk)`` and has that rank once bound
    to a call. Its block form reads every pair; a single tile's :meth:`~Mask.covers`
    and :meth:`~Mask.hides` do not read it and answer False.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.dense(np.tril(np.ones((4, 4), dtype=bool)))
        >>> print(masks.text(mask, 4, 4))
        #...
        ##..
        ###.
        ####
        >>> bound = mask.bind(np, (1,), 2, 4, 4)  # batch (1,), 2 heads, Lq=Lk=4
        >>> bound.allowed.shape, bound.tile(np, 0, 2, 0, 4, 4, 4).shape
        ((1, 1, 4, 4), (1, 1, 2, 4))
    """

    kind: ClassVar[str] = "dense"
    own_axes: ClassVar[int | None] = 2
    pairs: ClassVar[bool] = True
    allowed: Any
    batch_shape: tuple[int, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed", array_argument(self.allowed, "dense",
                                                           "a boolean array"))

    @property
    def arrays(self):
        return (self.allowed,)

    def with_arrays(self, arrays):
        (allowed,) = arrays
        return replaced(self, allowed=allowed)

    def bind(self, xp, batch_shape, num_heads, lq, lk, device=None):
        # Lq x Lk values: moving them to another library or device at every call would
        # be a large hidden cost, so the array must already be where the call runs.
        check_beside(xp, device, self.allowed, "dense mask")
        return super().bind(xp, batch_shape, num_heads, lq, lk, device)

    def for_call(self, xp, batch_shape, num_heads, lq, lk, device=None):
        full_shape = (*batch_shape, num_heads, lq, lk)
        padding = _padding_hint(self.allowed, batch_shape, lk)
        if not xp.isdtype(self.allowed.dtype, "bool"):
            floating = xp.isdtype(self.allowed.dtype, "real floating")
            hint = (" (scores to add go in bias=)" if floating else padding
                    or " (a 0/1 array: compare it, mask=allowed == 1)")
            msg = ("dense mask must have dtype bool (True = attend); got "
                   f"dense.dtype={dtype_name(self.allowed.dtype)}{hint}")
            raise TypeError(msg)
        try:
            full = expand_to_rank(xp, self.allowed, full_shape, "dense mask")
        except ValueError as e:
            msg = f"{e}{padding}"
            raise ValueError(msg) from None
        return replaced(self, allowed=full, batch_shape=tuple(batch_shape))

    # A single tile's state would read the array: kernels ask the block form instead.
    def hides(self, q0, q1, k0, k1, lq, lk):
        return q0 >= q1 or k0 >= k1

    def covers(self, q0, q1, k0, k1, lq, lk):
        return False

    def block_states(self, grid):
        q0, q1, k0, k1 = (int(e) for e in (grid.q_edges[0], grid.q_edges[-1],
                                           grid.k_edges[0], grid.k_edges[-1]))
        allowed = host_copy(slice_tile(self.allowed, q0, q1, k0, k1))
        return None if allowed is None else pair_states(allowed, grid)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return slice_tile(self.allowed, q0, q1, k0, k1)

    def allows(self, xp, b, h, q, k, lq, lk):
        index = linear_index(tuple(self.allowed.shape), self.batch_shape or (), b, h, q, k)
        return xp.reshape(self.allowed, (-1,))[index]

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return replaced(self, allowed=slice_tile(self.allowed, q0, q1, k0, k1))

    def __repr__(self) -> str:
        return f"dense(shape={tuple(self.allowed.shape)})"


@dataclass(frozen=True, eq=False, repr=False)
class Function(Mask):
    """Pairs for which ``fn(b, h, q_idx, kv_idx, *args)`` is True: ``b`` the flat batch
    index, ``h`` the query head, ``q_idx`` and ``kv_idx`` the query and key indices of
    the whole call. ``fn`` receives integer arrays of the call's library that broadcast
    against each other and returns a boolean array (write it with operators and the
    library's functions: ``(q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])``).
    Made by :func:`~portattn.masks.function`.

    ``args`` (None, or a tuple of arrays) are arrays ``fn`` reads, passed after the
    indices: the mask's :attr:`~Mask.arrays`, copied into each call's library and
    device like any mask's. Given (even empty), they declare that ``fn`` reads nothing
    else, so its block form is remembered while their contents stay the same; without
    them ``fn`` may read anything and its block form is built anew at every call.
    :meth:`~Mask.restrict` moves ``q_origin`` and ``k_origin``, so ``fn`` still sees
    the whole call's indices.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> def causal_fn(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> mask = masks.function(causal_fn)
        >>> part = mask.restrict(np, 2, 4, 0, 4, 4, 4)  # queries [2, 4), every key
        >>> part
        function(causal_fn, q_origin=2)
        >>> print(masks.text(part, 2, 4))
        ###.
        ####
    """

    kind: ClassVar[str] = "function"
    own_axes: ClassVar[int | None] = None
    fn: Callable[..., Any]
    q_origin: int = 0
    k_origin: int = 0
    batch_shape: tuple[int, ...] | None = None
    num_heads: int | None = None
    args: tuple[Any, ...] | None = None
    context: Any = field(default=None, compare=False)
    """``(xp, device)`` of the call it is bound to."""
    _states: dict = field(default_factory=dict, compare=False)
    """Block states already built for this call, per grid (each call binds anew)."""
    _lock: Any = field(default_factory=threading.Lock, compare=False)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            msg = f"function expects a callable fn(b, h, q_idx, kv_idx); got {self.fn!r}"
            raise TypeError(msg)
        if self.args is not None:
            if not isinstance(self.args, (tuple, list)):
                msg = (f"function args must be a tuple of arrays fn reads; got "
                       f"args of type {type(self.args).__name__}")
                raise TypeError(msg)
            object.__setattr__(self, "args", tuple(
                array_argument(a, "function", "arrays", f"args[{n}]")
                for n, a in enumerate(self.args)))

    @property
    def arrays(self):
        return self.args or ()

    def with_arrays(self, arrays):
        if self.args is None:
            return super().with_arrays(arrays)
        if len(arrays) != len(self.args):
            msg = f"{self!r} holds {len(self.args)} arrays; got {len(arrays)}"
            raise ValueError(msg)
        return replaced(self, args=tuple(arrays))

    def structure(self):
        return (self.kind, self.fn, None if self.args is None else len(self.args),
                self.q_origin, self.k_origin, self.batch_shape, self.num_heads)

    def content_key(self):
        # Without args, what fn reads is unknown: nothing derived from it is reused.
        return None if self.args is None else super().content_key()

    def for_call(self, xp, batch_shape, num_heads, lq, lk, device=None):
        bound = replaced(self, batch_shape=tuple(batch_shape), num_heads=num_heads,
                         context=(xp, device), _states={}, _lock=threading.Lock())
        # One pair: a clear error now rather than deep inside a kernel. (Dask runs fn on
        # its chunks, in their library: nothing to ask it now.)
        if lq and lk and not is_dask_namespace(xp):
            probe = bound.tile(xp, 0, 1, 0, 1, lq, lk, device)
            if not xp.isdtype(probe.dtype, "bool"):
                msg = ("a mask function must return a boolean array; got "
                       f"dtype={dtype_name(probe.dtype)} from {_name(self.fn)}")
                raise TypeError(msg)
        return bound

    def _indices(self, xp: Any, device: Any) -> tuple[Any, Any]:
        batch, heads = self.batch_shape or (), self.num_heads or 1
        b = xp.reshape(xp.arange(math.prod(batch), device=device), (*batch, 1, 1, 1))
        h = xp.reshape(xp.arange(heads, device=device), (heads, 1, 1))
        return b, h

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        b, h = self._indices(xp, device)
        rows = xp.arange(q0 + self.q_origin, q1 + self.q_origin, device=device)[:, None]
        cols = xp.arange(k0 + self.k_origin, k1 + self.k_origin, device=device)[None, :]
        allowed = self.fn(b, h, rows, cols, *self.arrays)
        return allowed if hasattr(allowed, "shape") else xp.asarray(allowed, device=device)

    def allows(self, xp, b, h, q, k, lq, lk):
        return self.fn(b, h, q + self.q_origin, k + self.k_origin, *self.arrays)

    def hides(self, q0, q1, k0, k1, lq, lk):
        return q0 >= q1 or k0 >= k1

    def covers(self, q0, q1, k0, k1, lq, lk):
        return False

    def block_states(self, grid):
        if self.context is None:
            return None
        xp, device = self.context
        key = (tuple(grid.q_edges), tuple(grid.k_edges), grid.q_len, grid.kv_len,
               self.q_origin, self.k_origin, self.batch_shape, self.num_heads, id(xp))
        with self._lock:
            if key in self._states:
                return self._states[key]
        states = self._evaluate(xp, device, grid)
        if states is not None:
            with self._lock:
                self._states[key] = states
        return states

    def _evaluate(self, xp: Any, device: Any, grid: Grid) -> Any:
        """Every pair of the grid, a few query blocks at a time."""
        import numpy as np

        if len(grid.q_edges) < 2:  # no query block: no pair to evaluate
            return np.zeros((0, len(grid.k_edges) - 1), np.int8)
        rows = max(1, CHUNK_PAIRS // max(1, int(grid.k_edges[-1] - grid.k_edges[0])
                                         * math.prod(self.batch_shape or ())
                                         * (self.num_heads or 1)))
        parts, first = [], 0
        edges = grid.q_edges
        while first < len(edges) - 1:
            last = first + 1  # query blocks [first, last) in this chunk
            while last < len(edges) - 1 and edges[last + 1] - edges[first] <= rows:
                last += 1
            allowed = host_copy(self.tile(xp, int(edges[first]), int(edges[last]),
                                          int(grid.k_edges[0]), int(grid.k_edges[-1]),
                                          grid.q_len, grid.kv_len, device))
            if allowed is None:  # traced: the values do not exist yet
                return None
            chunk = type(grid)(edges[first:last + 1], grid.k_edges, grid.q_len, grid.kv_len)
            parts.append(pair_states(allowed, chunk))
            first = last
        lead = np.broadcast_shapes(*(p.shape[:-2] for p in parts))
        return np.concatenate([np.broadcast_to(p, (*lead, *p.shape[-2:])) for p in parts],
                              axis=-2)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return replaced(self, q_origin=self.q_origin + q0, k_origin=self.k_origin + k0)

    def __repr__(self) -> str:
        moved = "".join(f", {n}={getattr(self, n)}" for n in ("q_origin", "k_origin")
                        if getattr(self, n))
        args = "" if self.args is None else ", args=(" + ", ".join(
            f"shape={tuple(a.shape)}" for a in self.args) + ")"
        return f"function({_name(self.fn)}{args}{moved})"


def _padding_hint(allowed: Any, batch_shape: tuple[int, ...], lk: int) -> str:
    """A hint for a ``(*batch, Lk)`` padding mask (transformers' ``attention_mask``),
    which does not broadcast as a dense mask."""
    if tuple(allowed.shape) != (*batch_shape, lk) or not batch_shape:
        return ""
    return ("; a (*batch, Lk) padding mask, like transformers' attention_mask, is "
            "masks.key_lengths(lengths) (right padding) or masks.key_ranges(start, stop) "
            "(left padding)")


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
