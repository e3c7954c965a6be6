"""What every mask kind builds on: the :class:`Mask` protocol, :class:`Band`, the
combinations ``a & b`` (:class:`Intersection`) and ``a | b`` (:class:`Union`), and the
grid of tiles a kind classifies (:class:`Grid`, :data:`HIDDEN`/:data:`PARTIAL`/
:data:`FULL`).

The kinds live in sibling modules that import this one and nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from .._lib import own_copy, run_import_hooks, torch_compiling
from ._values import content_of

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

__all__ = ["FULL", "HIDDEN", "PARTIAL", "POSITIONAL", "Band", "Grid", "Intersection", "Mask",
           "Union", "along", "band_states", "expand_to_rank", "interval_states", "leaves",
           "linear_index",
           "per_batch", "per_position", "same_rank", "slice_tile",
           "tile_states",
           "within"]

POSITIONAL = frozenset({"causal", "sliding_window"})
"""Kinds defined by positions alone: :meth:`Mask.band` describes them completely."""

HIDDEN, PARTIAL, FULL = 0, 1, 2
"""A tile's state in a block form: no pair allowed, some, every one. Intersections take
the smallest state of their parts and unions the largest."""


def before_creating() -> None:
    """What the public constructors call first: the ``on_import`` of every library
    imported now runs before its first mask (JAX: masks become pytrees), so a compiler
    that stops tracing inside one never holds a half-built mask."""
    run_import_hooks()


@dataclass(frozen=True)
class Band:
    """Key ``j`` is allowed for query row ``i`` iff ``lower <= j - i <= upper``.

    Rows and keys are array indices (``0 <= i < Lq``, ``0 <= j < Lk``); alignment and
    any shift are already folded in. ``None`` leaves a side unbounded. Top-left causal
    is ``Band(None, 0)``; bottom-right causal is ``Band(None, Lk - Lq)``.
    :meth:`Mask.band` gives a mask's causal and sliding-window parts as one band, and
    ``a & b`` intersects two bands. Tile bounds are half-open: rows ``[q0, q1)``,
    keys ``[k0, k1)``.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> band = (masks.causal() & masks.sliding_window(2)).band(4, 6)
        >>> band
        Band(lower=0, upper=2)
        >>> band.key_range(0, 2, 6), band.covers(2, 4, 4, 5), band.hides(0, 2, 4, 6)
        ((0, 4), True, True)
        >>> band.tile(np, 0, 2, 0, 6).astype(int)
        array([[1, 1, 1, 0, 0, 0],
               [0, 1, 1, 1, 0, 0]])
        >>> band & masks.Band(None, 1)
        Band(lower=0, upper=1)
    """

    lower: int | None = None
    upper: int | None = None

    def __and__(self, other: Band) -> Band:
        return Band(_max(self.lower, other.lower), _min(self.upper, other.upper))

    @property
    def empty(self) -> bool:
        """No pair at all: the lower bound lies above the upper."""
        return self.lower is not None and self.upper is not None and self.lower > self.upper

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

    def key_spans(self, lq: int, lk: int) -> tuple[Any, Any]:
        """Each row's keys, ``(start, stop)``: NumPy int64 arrays of ``Lq`` entries,
        row ``i`` attending keys ``start[i] <= j < stop[i]`` (none where ``stop <=
        start``)."""
        import numpy as np

        rows = np.arange(lq, dtype=np.int64)
        start = np.zeros(lq, np.int64) if self.lower is None else rows + self.lower
        stop = np.full(lq, lk, np.int64) if self.upper is None else rows + self.upper + 1
        return np.clip(start, 0, lk), np.clip(stop, 0, lk)

    def covers(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Every pair of the tile is allowed."""
        return ((self.lower is None or k0 - (q1 - 1) >= self.lower)
                and (self.upper is None or (k1 - 1) - q0 <= self.upper))

    def hides(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """No pair of the tile is allowed."""
        if q0 >= q1 or k0 >= k1:
            return True
        if self.empty:
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

    def block_states(self, grid: Grid) -> Any:
        """The state of every tile of ``grid`` (see ``band_states``)."""
        return band_states(grid, self.lower, self.upper)

    def allows(self, q: Any, k: Any) -> Any:
        """Whether row ``q`` attends key ``k`` (integer arrays that broadcast)."""
        return within(k - q, self.lower, self.upper)


def within(diff: Any, lower: Any, upper: Any) -> Any:
    """``lower <= diff <= upper`` elementwise (``None``: unbounded)."""
    allowed = None
    if lower is not None:
        allowed = diff >= lower
    if upper is not None:
        allowed = diff <= upper if allowed is None else (allowed & (diff <= upper))
    return (diff >= 0) | (diff < 0) if allowed is None else allowed


def per_batch(xp: Any, a: Any, b: Any) -> Any:
    """``a``'s value for flat batch index ``b`` (``a`` has the batch shape)."""
    return xp.reshape(a, (-1,))[b]


def per_position(xp: Any, a: Any, b: Any, i: Any) -> Any:
    """``a[b, i]`` for ``a`` of shape ``(*batch, L)`` or ``(1, ..., 1, L)`` (shared by the
    batch), with ``b`` a flat batch index."""
    length = a.shape[-1]
    rows = 1
    for n in a.shape[:-1]:
        rows *= n
    flat = xp.reshape(a, (-1,))
    return flat[i] if rows == 1 else flat[b * length + i]


def linear_index(shape: tuple[int, ...], batch_shape: tuple[int, ...], b: Any,
                 *trailing: Any) -> Any:
    """Flat index into a full-rank array of ``shape`` (``(*batch|1, ...)``, size-1 axes
    broadcast) of flat batch index ``b`` and the ``trailing`` indices."""
    coords, rest = [], b
    for size in reversed(batch_shape):
        coords.append(rest % size)
        rest = rest // size
    coords.reverse()
    index: Any = 0
    for n, c in zip(shape, [*coords, *trailing], strict=True):
        index = index * n + (c if n > 1 else 0)
    return index


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _min(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


@dataclass(frozen=True, eq=False)
class Grid:
    """Tiles to classify: query rows ``[q_edges[a], q_edges[a + 1])`` against keys
    ``[k_edges[b], k_edges[b + 1])``, for a call of ``q_len`` queries and ``kv_len``
    keys. Edges are increasing NumPy integer arrays; the tiles need not start at 0.

    What :meth:`Mask.block_states` receives; :func:`block_mask` builds a uniform one.

    Example:
        >>> from portattn import masks
        >>> grid = masks.Grid.uniform(8, 8, 4, 4)
        >>> grid.q_edges.tolist(), grid.k_last.tolist()
        ([0, 4, 8], [3, 7])
        >>> masks.causal().block_states(grid).tolist()  # 0 hidden, 1 partial, 2 full
        [[1, 0], [2, 1]]
    """

    q_edges: Any
    k_edges: Any
    q_len: int
    kv_len: int

    @classmethod
    def uniform(cls, q_len: int, kv_len: int, block_q: int, block_k: int) -> Grid:
        """Blocks of ``block_q`` queries and ``block_k`` keys (the last ones shorter)."""
        import numpy as np

        return cls(_edges(np, q_len, block_q), _edges(np, kv_len, block_k), q_len, kv_len)

    @classmethod
    def one(cls, q0: int, q1: int, k0: int, k1: int, q_len: int, kv_len: int) -> Grid:
        """The single tile ``[q0, q1) x [k0, k1)``."""
        import numpy as np

        return cls(np.asarray([q0, q1]), np.asarray([k0, k1]), q_len, kv_len)

    @property
    def q_first(self) -> Any:
        """First row of each query block."""
        return self.q_edges[:-1]

    @property
    def q_last(self) -> Any:
        """Last row of each query block (inclusive)."""
        return self.q_edges[1:] - 1

    @property
    def k_first(self) -> Any:
        """First key of each key block."""
        return self.k_edges[:-1]

    @property
    def k_last(self) -> Any:
        """Last key of each key block (inclusive)."""
        return self.k_edges[1:] - 1

    def reduce_q(self, op: Any, values: Any) -> Any:
        """``op`` (a NumPy ufunc: ``minimum``, ``logical_or``...) over each query block
        of ``values`` (positions on the last axis)."""
        return _reduce_blocks(op, values, self.q_edges)

    def reduce_k(self, op: Any, values: Any) -> Any:
        """:meth:`reduce_q` over each key block."""
        return _reduce_blocks(op, values, self.k_edges)


def _edges(np: Any, length: int, block: int) -> Any:
    return np.append(np.arange(0, length, max(block, 1)), length) if length else \
        np.zeros(1, dtype=np.int64)


def _reduce_blocks(op: Any, values: Any, edges: Any) -> Any:
    start = int(edges[0])
    return op.reduceat(values[..., start:int(edges[-1])], edges[:-1] - start, axis=-1)


def tile_states(hidden: Any, full: Any, xp: Any = None) -> Any:
    """Tile states from two boolean arrays: what a kind's ``block_states`` returns.

    Args:
        hidden: True for tiles where no pair is allowed.
        full: True for tiles where every pair is allowed (``hidden`` wins).
        xp: NumPy by default, or a namespace with NumPy's ``where`` and ``astype``,
            such as ``jax.numpy`` for states built on the device.

    Returns:
        An int8 array of the broadcast shape, holding :data:`HIDDEN` where
        ``hidden``, else :data:`FULL` where ``full``, else :data:`PARTIAL`.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.tile_states(np.array([True, False, False]),
        ...                   np.array([True, True, False])).tolist()
        [0, 2, 1]
    """
    if xp is None or getattr(xp, "__name__", None) == "numpy":
        import numpy as np

        hidden, full = np.asarray(hidden, dtype=bool), np.asarray(full, dtype=bool)
        # (PARTIAL + full) * not hidden (HIDDEN is 0, FULL is PARTIAL + 1) on int8 views
        # of the booleans: a block form is built per call, and this is some 50x faster
        # than nested wheres at 128 x 1024 tiles
        return np.asarray((full.view(np.int8) + np.int8(PARTIAL))
                          * np.logical_not(hidden).view(np.int8))
    return xp.where(hidden, HIDDEN, xp.where(full, FULL, PARTIAL)).astype(xp.int8)


def band_states(grid: Grid, lower: Any, upper: Any, xp: Any = None, rank: int = 2) -> Any:
    """Tile states of ``lower <= j - i <= upper`` (``None``: unbounded). The bounds
    may be arrays shaped ``(*batch, 1, 1, 1)``, one band per batch element, of the
    namespace ``xp`` (NumPy by default); the states have rank ``rank`` at least."""
    import numpy as np

    q_first, q_last, k_first, k_last = edges_at_rank(grid, rank)
    smallest, largest = k_first - q_last, k_last - q_first  # of j - i over each tile
    hidden, full = np.zeros(smallest.shape, dtype=bool), np.ones(smallest.shape, dtype=bool)
    if lower is not None:
        hidden, full = hidden | (largest < lower), full & (smallest >= lower)
    if upper is not None:
        hidden, full = hidden | (smallest > upper), full & (largest <= upper)
    if lower is not None and upper is not None:
        hidden = hidden | (lower > upper)  # an empty band
    return tile_states(hidden, full, xp)


def interval_states(q_lo: Any, q_hi: Any, k_lo: Any, k_hi: Any, q_exact: Any = True,
                    k_exact: Any = True) -> Any:
    """Tile states of "query id == key id" from each block's smallest and largest id
    (blocks on the last axis; ``lo > hi`` marks a block with no id at all). ``exact``:
    every position of the block carries an id (no padding), needed for :data:`FULL`."""
    ql, qh, kl, kh = q_lo[..., :, None], q_hi[..., :, None], k_lo[..., None, :], k_hi[..., None, :]
    hidden = (ql > qh) | (kl > kh) | (qh < kl) | (kh < ql)
    full = (ql == qh) & (kl == kh) & (ql == kl)
    if q_exact is not True:
        full = full & q_exact[..., :, None]
    if k_exact is not True:
        full = full & k_exact[..., None, :]
    return tile_states(hidden, full)


def combine_states(states: list[Any], union: bool, xp: Any = None) -> Any:
    """The tile states of an intersection or a union of parts.

    Args:
        states: each part's states (broadcastable arrays), or None for a part whose
            tiles are unknown (partial everywhere).
        union: False for an intersection (the smallest state of the parts), True for
            a union (the largest).
        xp: as in :func:`tile_states`.

    Returns:
        The combined int8 states; None (every tile partial) when no part's states
        are known.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> a, b = np.array([0, 1, 2], dtype=np.int8), np.array([2, 2, 1], dtype=np.int8)
        >>> masks.combine_states([a, b], union=False).tolist()
        [0, 1, 1]
        >>> masks.combine_states([a, b], union=True).tolist()
        [2, 2, 2]
        >>> masks.combine_states([a, None], union=True).tolist()
        [1, 1, 2]
        >>> masks.combine_states([None], union=False) is None
        True
    """
    if xp is None:
        import numpy as xp
    known = [s for s in states if s is not None]
    if not known:
        return None
    pick = xp.maximum if union else xp.minimum
    result = known[0]
    for s in known[1:]:
        result = pick(result, s)
    if len(known) < len(states):  # a part whose tiles are unknown: partial everywhere
        result = pick(result, PARTIAL)
    return result.astype(xp.int8)


class Mask:
    """Base of every mask kind; masks combine with ``&`` (:class:`Intersection`) and
    ``|`` (:class:`Union`).

    The constructors in :mod:`portattn.masks` (:func:`causal`, :func:`key_lengths`,
    ...) make masks; kernels read them through this protocol. Each built-in kind is
    a frozen dataclass deriving from it. Tiles are half-open, rows ``[q0, q1)`` and keys
    ``[k0, k1)``, of a call with ``lq`` queries and ``lk`` keys; ``xp`` is the call's
    array namespace. A kind sets or overrides:

    - ``kind``: its name (the class attribute a kernel's ``masks`` declaration
      names, see :data:`KINDS`);
    - :meth:`tile`: the boolean tile, ``(q1 - q0, k1 - k0)`` or of full rank
      ``(*batch, H, tq, tk)`` with broadcastable 1s (required);
    - :meth:`allows`: the same question pair by pair, on indices that may only be
      known on the device (required);
    - :meth:`restrict`: the mask of a sub-problem in its own coordinates (required);
    - :meth:`for_call`: check the mask against the call's shapes and normalise it
      (the default keeps it as it is); :meth:`bind` calls it once the mask holds the
      call's own copies of its arrays;
    - :meth:`block_states`: the state of every tile of a :class:`Grid`, read by
      :func:`block_mask` (the default, None, counts every tile as partial);
    - :meth:`key_range`, :meth:`covers`, :meth:`hides`: one tile's needs, known
      without reading data (the default range is every key; the default
      :meth:`covers` and :meth:`hides` ask :meth:`block_states` about the tile);
    - :meth:`band`: for positional kinds (:data:`POSITIONAL`), the band they allow;
    - :attr:`arrays` and :meth:`with_arrays`: for kinds that hold arrays, and where
      those lie against the call's axes (:attr:`own_axes`, :attr:`pairs`);
    - :meth:`structure` and :meth:`key`: equality and hashing;
      :meth:`content_key`: the key under which block forms and other derived data
      are remembered across calls (override it for a kind whose pairs depend on
      more than its parameters and arrays).

    :attr:`parts`, :attr:`kinds` and :meth:`parts_of` need no override.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.causal() & masks.sliding_window(2)
        >>> sorted(mask.kinds), [p.kind for p in mask.parts_of("sliding_window")]
        (['causal', 'sliding_window'], ['sliding_window'])
        >>> mask.hides(0, 2, 4, 6, 4, 6), mask.covers(2, 4, 4, 5, 4, 6)
        (True, True)
        >>> mask.tile(np, 0, 2, 0, 6, 4, 6).astype(int)
        array([[1, 1, 1, 0, 0, 0],
               [0, 1, 1, 1, 0, 0]])
        >>> print(masks.text(mask, 4, 6))
        ###...
        .###..
        ..###.
        ...###
        >>> mask == masks.causal() & masks.sliding_window(2)
        True
    """

    kind: ClassVar[str] = ""
    own_axes: ClassVar[int | None] = 0
    """Trailing axes of each of its arrays, once bound, that are the kind's own (ids
    along positions: 1; a layout or a dense mask's pairs: 2); the leading ones run
    along ``(*batch, H)``. None: arrays read whole (a mask function's arguments)."""
    pairs: ClassVar[bool] = False
    """Whether its array holds a value per (query, key) pair, ``Lq x Lk`` (dense masks):
    read a tile at a time, never whole."""

    @property
    def parts(self) -> tuple[Mask, ...]:
        """The masks this one intersects (itself for a single kind)."""
        return (self,)

    @property
    def kinds(self) -> frozenset[str]:
        """Every kind inside: a union adds ``"union"`` and the kinds of its members."""
        return frozenset(k for p in self.parts for k in p._own_kinds())

    def _own_kinds(self) -> frozenset[str]:
        return frozenset({self.kind})

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

    def __or__(self, other: Mask) -> Mask:
        if not isinstance(other, Mask):
            return NotImplemented
        return Union(_alternatives(self) + _alternatives(other))

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

    def block_states(self, grid: Grid) -> Any:
        """The state of every tile of ``grid``: a NumPy int8 array of :data:`HIDDEN`,
        :data:`PARTIAL` and :data:`FULL`, shaped ``(n_query_blocks, n_key_blocks)`` or
        with leading axes that broadcast against ``(*batch, H)``; None when unknown
        (values that cannot be read now): every tile then counts as partial.

        Built from the structure (and the host copies of small arrays) in time
        proportional to the number of tiles; what :func:`~portattn.masks.block_mask` reads."""
        return None

    def device_states(self, grid: Grid, xp: Any, rank: int,
                      evaluate: Callable[[Mask], Any]) -> Any:
        """The state of every tile of ``grid`` as an ``xp`` int8 array of rank ``rank``
        (``(*batch, H, n_query_blocks, n_key_blocks)``, size-1 axes where the mask does
        not vary), computed on the device from the mask's own arrays when their values
        cannot be read on the host (JAX arrays while ``jax.jit`` traces).

        Where the values can be read these are the host's states; a kind computes them
        from its arrays with :meth:`~portattn.masks.Mask.array_states`, in time
        proportional to the tiles and positions; ``evaluate(part)`` gives those of a
        part that has no such formula (dense masks, layouts and mask functions:
        evaluated pair by pair, a way of the caller's library)."""
        host = self.block_states(grid)
        if host is not None:
            return full_rank(xp, xp.asarray(host), rank)
        states = self.array_states(grid, xp, rank)
        return full_rank(xp, evaluate(self) if states is None else states, rank)

    def array_states(self, grid: Grid, xp: Any, rank: int) -> Any:
        """The states of :meth:`~portattn.masks.Mask.device_states` from the mask's arrays
        with ``xp`` (which need not be readable), or None when the kind has no formula
        for them."""
        return None

    def key_range(self, q0: int, q1: int, lq: int, lk: int) -> tuple[int, int]:
        """Half-open range of keys that some query in ``[q0, q1)`` may attend."""
        return 0, lk

    def key_spans(self, lq: int, lk: int) -> tuple[Any, Any] | None:
        """Where each query row attends one run of keys: ``(start, stop)``, NumPy int64
        arrays shaped ``(*lead, Lq)`` whose leading axes broadcast against ``(*batch,
        H)``, row ``i`` attending keys ``start[i] <= j < stop[i]`` (none where ``stop <=
        start``). None when a row may attend keys apart from each other, or when the
        values cannot be read now (traced, lazy or unbound arrays).

        A structural query: a planner lays blocks along these runs (a staircase, a
        window, the documents of a packed row) without evaluating pairs.

        Example:
            >>> import numpy as np
            >>> from portattn import masks
            >>> ids = np.array([0, 0, 0, 1, 1])
            >>> mask = (masks.causal() & masks.documents(ids)).bind(np, (1,), 1, 5, 5)
            >>> [a.tolist() for a in mask.key_spans(5, 5)]
            [[[[0, 0, 0, 3, 3]]], [[[1, 2, 3, 4, 5]]]]
            >>> print(masks.sink_tokens(1).key_spans(5, 5))  # keys 0 and i - 1 apart
            None
        """
        return None

    def covers(self, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int) -> bool:
        """True when every pair in the tile is allowed, known without reading data."""
        return tile_state(self, q0, q1, k0, k1, lq, lk) == FULL

    def hides(self, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int) -> bool:
        """True when no pair in the tile is allowed, known without reading data."""
        return q0 >= q1 or k0 >= k1 or tile_state(self, q0, q1, k0, k1, lq, lk) == HIDDEN

    def tile(self, xp: Any, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int,
             device: Any = None) -> Any:
        """Boolean array for the tile (True = attend)."""
        raise NotImplementedError

    def allows(self, xp: Any, b: Any, h: Any, q: Any, k: Any, lq: int, lk: int) -> Any:
        """Whether query ``q`` attends key ``k`` in batch element ``b`` (flat index over
        the batch dims) and query head ``h``: integer arrays (or scalars) that broadcast
        together, possibly traced. The mask as FlexAttention's ``mask_mod``, for
        kernels whose tile offsets are only known on the device (:meth:`tile` is the
        same for a tile whose bounds are Python ints)."""
        raise NotImplementedError

    def bind(self, xp: Any, batch_shape: tuple[int, ...], num_heads: int, lq: int,
             lk: int, device: Any = None) -> Mask:
        """The mask of one call: holding the call's own copies of its arrays (in the
        call's library ``xp``, on ``device``), checked against the call's shapes and
        normalised for it (:meth:`~portattn.masks.Mask.for_call`).

        The copies are what make a bound mask a value: whatever the caller writes to
        the arrays afterwards, by any route, the call, its block form and its backward
        see the mask as it was when the call began."""
        if not self.arrays:
            return self.for_call(xp, batch_shape, num_heads, lq, lk, device)
        own = self.with_arrays([own_copy(xp, a, device) for a in self.arrays])
        bound = own.for_call(xp, batch_shape, num_heads, lq, lk, device)
        for part in (bound, *leaves(bound)):  # arrays no caller holds: content keys hold
            object.__setattr__(part, "_own_arrays", True)
        return bound

    def for_call(self, xp: Any, batch_shape: tuple[int, ...], num_heads: int, lq: int,
                 lk: int, device: Any = None) -> Mask:
        """Check the mask against a call's shapes (its arrays are already the call's own,
        in ``xp`` on ``device``) and return it normalised for the call: what a kind
        overrides; callers use :meth:`~portattn.masks.Mask.bind`."""
        return self

    def content_key(self) -> Any:
        """What anything derived from this mask (a block form, index tables, plans) may
        be remembered under across calls: equal keys mean the same pairs for every
        call shape. None where no key can promise that.

        A kind made of parameters alone gives its :meth:`~portattn.masks.Mask.key`; a
        kind holding arrays adds what they hold (library, device, shape and values) once
        bound to a call (:meth:`~portattn.masks.Mask.bind`: the arrays are then the
        call's own copies), and gives None before that, when the values cannot be read
        (tracing, lazy arrays) or are large (a long dense mask). A mask function gives
        None unless it declares what it reads (``args``).

        Example:
            >>> import numpy as np
            >>> from portattn import masks
            >>> masks.causal().content_key() == masks.causal().content_key()
            True
            >>> a = masks.key_lengths(np.array([3, 4])).bind(np, (2,), 1, 4, 4)
            >>> b = masks.key_lengths(np.array([3, 4])).bind(np, (2,), 1, 4, 4)
            >>> a.content_key() == b.content_key(), a == b  # same values, other arrays
            (True, False)
        """
        if not self.arrays:  # parameters alone: the key never changes (every call asks)
            found = self.__dict__.get("_content_key")
            if found is None:
                found = self.key()
                if not torch_compiling():  # masks are frozen: the memo is set once
                    object.__setattr__(self, "_content_key", found)
            return found
        if not self.__dict__.get("_own_arrays"):  # the caller's arrays may change
            return None
        content = content_of(self.arrays)
        return None if content is None else (self.structure(), content)

    def restrict(self, xp: Any, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int) -> Mask:
        """The mask of the sub-problem ``query[q0:q1]`` x ``key[k0:k1]``, in its own
        coordinates (for split-KV, ring attention and blockwise schedulers)."""
        raise NotImplementedError


def tile_state(mask: Mask, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int) -> int:
    """One tile's state over every batch element and head: :data:`HIDDEN` only when
    hidden everywhere, :data:`FULL` only when full everywhere."""
    if q0 >= q1 or k0 >= k1:
        return HIDDEN
    states = mask.block_states(Grid.one(q0, q1, k0, k1, lq, lk))
    if states is None:
        return PARTIAL
    if not states.size:  # no batch element: nothing to see
        return HIDDEN
    low, high = int(states.min()), int(states.max())
    return HIDDEN if high == HIDDEN else FULL if low == FULL else PARTIAL


def leaves(mask: Mask | None) -> list[Mask]:
    """Every single-kind part of ``mask``, inside intersections and unions.

    Example:
        >>> from portattn import masks
        >>> mask = masks.causal() & (masks.sliding_window(4) | masks.sink_tokens(2))
        >>> [p.kind for p in masks.leaves(mask)]
        ['causal', 'sliding_window', 'sink_tokens']
    """
    if mask is None:
        return []
    found = []
    for p in mask.parts:
        found += [m for member in p.members for m in leaves(member)] if isinstance(
            p, Union) else [p]
    return found


def _alternatives(mask: Mask) -> tuple[Mask, ...]:
    return mask.members if isinstance(mask, Union) else (mask,)


def all_allowed(xp: Any, q0: int, q1: int, k0: int, k1: int, device: Any = None) -> Any:
    """A tile that allows every pair."""
    return xp.ones((q1 - q0, k1 - k0), dtype=xp.bool, device=device)


class _Combination(Mask):
    """What intersections and unions share: members, their arrays and structure."""

    members: tuple[Mask, ...]
    union: ClassVar[bool]

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
        return type(self)(tuple(parts))

    def structure(self):
        return (self.kind, *(p.structure() for p in self.members))

    def key(self) -> tuple:
        return (self.kind, *(p.key() for p in self.members))

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        return type(self)(tuple(p.restrict(xp, q0, q1, k0, k1, lq, lk) for p in self.members))

    def for_call(self, xp, batch_shape, num_heads, lq, lk, device=None):
        return type(self)(tuple(p.for_call(xp, batch_shape, num_heads, lq, lk, device)
                                for p in self.members))

    def content_key(self):
        keys = [p.content_key() for p in self.members]
        return None if any(k is None for k in keys) else (self.kind, *keys)

    def block_states(self, grid):
        return combine_states([p.block_states(grid) for p in self.members], self.union)

    def device_states(self, grid, xp, rank, evaluate):
        return combine_states([p.device_states(grid, xp, rank, evaluate)
                               for p in self.members], self.union, xp)

    def allows(self, xp, b, h, q, k, lq, lk):
        allowed = None
        for p in self.members:
            a = p.allows(xp, b, h, q, k, lq, lk)
            allowed = a if allowed is None else (allowed | a if self.union else allowed & a)
        return allowed


@dataclass(frozen=True, eq=False, repr=False)
class Intersection(_Combination):
    """Pairs allowed by every one of ``members``, made by ``a & b``.

    Intersections flatten: ``a & b & c`` has three :attr:`~Mask.parts`. Its
    causal and sliding-window parts fold into one :meth:`~Mask.band`.

    Example:
        >>> from portattn import masks
        >>> mask = masks.causal() & masks.sliding_window(1) & masks.chunks(4)
        >>> type(mask).__name__, len(mask.parts)
        ('Intersection', 3)
        >>> mask.band(6, 6)
        Band(lower=-1, upper=0)
        >>> print(masks.text(mask, 6, 6))
        #.....
        ##....
        .##...
        ..##..
        ....#.
        ....##
    """

    kind: ClassVar[str] = "intersection"
    union: ClassVar[bool] = False
    members: tuple[Mask, ...]

    @property
    def parts(self):
        return self.members

    def band(self, lq, lk):
        bands = [p.band(lq, lk) for p in self.members if p.kind in POSITIONAL]
        if not bands:
            return None
        band = bands[0]
        for b in bands[1:]:
            band = band & b
        return band

    def block_states(self, grid):
        # The positional parts as one band (two windows may hide a tile that neither
        # hides alone), the others one by one.
        band = self.band(grid.q_len, grid.kv_len)
        states = [p.block_states(grid) for p in self.members if p.kind not in POSITIONAL]
        if band is not None:
            states.append(band.block_states(grid))
        return combine_states(states, union=False)

    def device_states(self, grid, xp, rank, evaluate):
        band = self.band(grid.q_len, grid.kv_len)
        states = [p.device_states(grid, xp, rank, evaluate) for p in self.members
                  if p.kind not in POSITIONAL]
        if band is not None:
            states.append(full_rank(xp, xp.asarray(band.block_states(grid)), rank))
        return combine_states(states, union=False, xp=xp)

    def key_range(self, q0, q1, lq, lk):
        lo, hi = 0, lk
        for p in self.members:
            plo, phi = p.key_range(q0, q1, lq, lk)
            lo, hi = max(lo, plo), min(hi, phi)
        return lo, hi

    def key_spans(self, lq, lk):
        import numpy as np

        spans = []
        for p in self.members:  # the parts that may have none first, the band's last
            if p.kind not in POSITIONAL:
                found = p.key_spans(lq, lk)
                if found is None:
                    return None
                spans.append(found)
        band = self.band(lq, lk)
        if band is not None:
            spans.append(band.key_spans(lq, lk))
        start, stop = spans[0]
        for a, z in spans[1:]:
            start, stop = np.maximum(start, a), np.minimum(stop, z)
        return start, stop

    def covers(self, q0, q1, k0, k1, lq, lk):
        return all(p.covers(q0, q1, k0, k1, lq, lk) for p in self.members)

    def hides(self, q0, q1, k0, k1, lq, lk):
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
            allowed = t if allowed is None else xp.logical_and(*same_rank(xp, allowed, t))
        return all_allowed(xp, q0, q1, k0, k1, device) if allowed is None else allowed

    def __repr__(self) -> str:
        return " & ".join(repr(p) for p in self.members)


@dataclass(frozen=True, eq=False, repr=False)
class Union(_Combination):
    """Pairs allowed by any one of ``members``, made by ``a | b``.

    For example a window with sink tokens, ``sliding_window(w) | sink_tokens(4)``, or
    a prefix-LM, ``causal() | prefix(lengths)``. Unions flatten like intersections,
    and a union is a single part of an intersection: its kinds are ``"union"`` and
    those of its members.

    Example:
        >>> from portattn import masks
        >>> mask = masks.sliding_window(1) | masks.sink_tokens(1)
        >>> sorted(mask.kinds), len(mask.members)
        (['sink_tokens', 'sliding_window', 'union'], 2)
        >>> print(masks.text(mask, 4, 6))
        ###...
        #.##..
        #..##.
        #...##
    """

    kind: ClassVar[str] = "union"
    union: ClassVar[bool] = True
    members: tuple[Mask, ...]

    def _own_kinds(self):
        return frozenset({"union"}).union(*(p.kinds for p in self.members))

    def key_range(self, q0, q1, lq, lk):
        ranges = [p.key_range(q0, q1, lq, lk) for p in self.members]
        ranges = [(lo, hi) for lo, hi in ranges if lo < hi]
        return (0, 0) if not ranges else (min(r[0] for r in ranges), max(r[1] for r in ranges))

    def covers(self, q0, q1, k0, k1, lq, lk):
        return any(p.covers(q0, q1, k0, k1, lq, lk) for p in self.members)

    def hides(self, q0, q1, k0, k1, lq, lk):
        return all(p.hides(q0, q1, k0, k1, lq, lk) for p in self.members)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        allowed = None
        for p in self.members:
            band = p.band(lq, lk) if p.kind in POSITIONAL else None
            if band is not None and band.hides(q0, q1, k0, k1):
                continue  # cheap for a band; other kinds' tiles cost less than asking
            t = p.tile(xp, q0, q1, k0, k1, lq, lk, device)
            allowed = t if allowed is None else xp.logical_or(*same_rank(xp, allowed, t))
        return xp.logical_not(all_allowed(xp, q0, q1, k0, k1, device)) if allowed is None \
            else allowed

    def __repr__(self) -> str:
        return "(" + " | ".join(repr(p) for p in self.members) + ")"


def replaced(mask: Mask, **changes: Any) -> Mask:
    """A copy of a frozen mask with some fields changed, without re-running the
    checks of its constructor (the values come from a mask that passed them, or are
    arrays being moved: tracers, placeholders)."""
    copy = object.__new__(type(mask))
    for f in fields(mask):
        object.__setattr__(copy, f.name, changes.get(f.name, getattr(mask, f.name)))
    return copy


def expand_to_rank(xp: Any, array: Any, target: tuple[int, ...], what: str) -> Any:
    """Check that ``array`` broadcasts to ``target``; give it ``target``'s rank.

    Args:
        xp: the array namespace of ``array``.
        array: a bias or a boolean mask.
        target: the call's full shape, ``(*batch, Hq, Lq, Lk)``.
        what: the argument's name, for the error message.

    Returns:
        ``array`` reshaped with leading 1s up to ``len(target)`` dims (no copy).

    Raises:
        ValueError: ``array`` does not broadcast to ``target``.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.expand_to_rank(np, np.zeros((8, 8)), (2, 4, 8, 8), "bias").shape
        (1, 1, 8, 8)
    """
    shape = tuple(array.shape)
    ok = len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(shape[::-1], target[::-1], strict=False))
    if not ok:
        msg = (f"{what} of shape {shape} does not broadcast to "
               f"(*batch, Hq, Lq, Lk) = {target}")
        raise ValueError(msg)
    return xp.reshape(array, (1,) * (len(target) - len(shape)) + shape)


def slice_tile(array: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
    """One tile of a full-rank array (a bound dense mask, a bias).

    Args:
        array: ``(..., Lq | 1, Lk | 1)``.
        q0: first row of the tile.
        q1: end of the rows (exclusive).
        k0: first column of the tile.
        k1: end of the columns (exclusive).

    Returns:
        ``array[..., q0:q1, k0:k1]``, but a size-1 (broadcast) axis stays whole.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.slice_tile(np.zeros((1, 2, 8, 8)), 0, 4, 4, 8).shape
        (1, 2, 4, 4)
        >>> masks.slice_tile(np.zeros((1, 2, 1, 8)), 0, 4, 4, 8).shape
        (1, 2, 1, 4)
    """
    rows = slice(None) if array.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if array.shape[-1] == 1 else slice(k0, k1)
    return array[..., rows, cols]


def full_rank(xp: Any, states: Any, rank: int) -> Any:
    """``states`` with leading size-1 axes up to ``rank`` dims."""
    return xp.reshape(states, (1,) * (rank - states.ndim) + tuple(states.shape))


def edges_at_rank(grid: Grid, rank: int) -> tuple[Any, Any, Any, Any]:
    """``(q_first, q_last, k_first, k_last)`` of ``grid`` laid out to broadcast at rank
    ``rank``: query blocks ``(1, ..., nq, 1)``, key blocks ``(1, ..., 1, nk)``."""
    q_shape, k_shape = (1,) * (rank - 2) + (-1, 1), (1,) * (rank - 2) + (1, -1)
    return (grid.q_first.reshape(q_shape), grid.q_last.reshape(q_shape),
            grid.k_first.reshape(k_shape), grid.k_last.reshape(k_shape))


def blocked(xp: Any, values: Any, edges: Any) -> Any:
    """``(..., L) -> (..., n_blocks, block)`` for blocks of equal size at ``edges`` (the
    last one filled with its last value, which changes no minimum, maximum, any or
    all)."""
    block = int(edges[1] - edges[0]) if len(edges) > 1 else 1
    count = len(edges) - 1
    extra = count * block - values.shape[-1]
    if extra > 0:
        last = xp.broadcast_to(values[..., -1:], (*values.shape[:-1], extra))
        values = xp.concat([values, last], axis=-1)
    return xp.reshape(values, (*values.shape[:-1], count, block))


def column(xp: Any, a: Any) -> Any:
    """``(*batch) -> (*batch, 1, 1, 1)``: broadcasts against ``(*batch, H, tq, tk)``."""
    return xp.reshape(a, (*a.shape, 1, 1, 1))


def same_rank(xp: Any, *arrays: Any) -> tuple[Any, ...]:
    """``arrays`` with leading size-1 axes up to the largest rank (see :func:`along`)."""
    rank = max(len(a.shape) for a in arrays)
    return tuple(a if len(a.shape) == rank else xp.reshape(a, (1,) * (rank - len(a.shape))
                                                             + tuple(a.shape)) for a in arrays)


def along(xp: Any, a: Any, rank: int, axis: int) -> Any:
    """A 1-D ``a`` as an array of ``rank`` dims, laid along ``axis`` (-2 queries, -1
    keys). Operands of one rank: JAX's ``numpy_rank_promotion("raise")`` refuses
    to broadcast a shorter one."""
    shape = [1] * max(rank, -axis)
    shape[axis] = a.shape[0]
    return xp.reshape(a, tuple(shape))


class Aligned(Mask):
    """A kind defined by absolute positions, bottom-right aligned: key ``j`` sits at
    ``j + origin`` and query ``i`` at ``i + Lk - Lq + shift + origin``. ``shift`` and
    ``origin`` are 0 for a whole call; :meth:`Mask.restrict` sets them so a sub-problem
    keeps the positions it had in the whole."""

    shift: int
    origin: int

    def query_offset(self, lq: int, lk: int) -> int:
        """Absolute position of query 0."""
        return lk - lq + self.shift + self.origin

    @property
    def whole_call(self) -> bool:
        """Whether its positions are those of the call it meets: not a part cut from a
        larger call by :meth:`Mask.restrict` (whose arrays, lengths or layout still
        describe the whole, so the part's own sizes cannot check them)."""
        return not (getattr(self, "cut", False) or self.shift or self.origin)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        # cut: for the kinds that keep one (a top-left part has no shift or origin)
        return replaced(self, shift=self.shift + q0 - k0 + (lk - lq) - ((k1 - k0) - (q1 - q0)),
                        origin=self.origin + k0, cut=True)

    def _position_text(self) -> str:
        moved = [f"{n}={getattr(self, n)}" for n in ("shift", "origin") if getattr(self, n)]
        return "".join(f", {m}" for m in moved)
