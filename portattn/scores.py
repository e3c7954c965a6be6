"""Score changes as data: small learned tables whose entries join the scores, and
functions that map each score.

Masks say which pairs a query sees; a score change adds to the scores of the pairs it
sees, from a table a model learns: T5's relative-position buckets
(:func:`relative_position`), Swin's table of offsets inside a window
(:func:`window_table`), a pair bias gathered by the classes of the two tokens
(:func:`pair_table`), ALiBi with learned slopes (:func:`alibi`), and their sums
(``a + b``); :func:`show` draws one. Or it maps each score: :func:`function` (any
function of the score and its indices, FlexAttention's ``score_mod``, differentiated by
the library's autodiff) and :func:`softcap` (a learned cap). Pass one as
``portattn.attention(..., score_mod=...)``. The kernels that take them
(``Kernel.score_mod`` and ``Kernel.score_functions``) compute each tile's entries
from the table, never an ``Lq x Lk`` array, and the flash backward reduces
each tile's score gradient into the table: tile by tile in a fixed order, so the
table's gradient is the same on every run, and never a dense ``(Lq, Lk)`` gradient.

The change joins the scores where a ``bias`` does: after ``scale`` and ``softcap``,
beside ``bias`` and ALiBi, before the mask. Positions are aligned as for the masks
and ALiBi: query ``i`` of ``Lq`` sits at ``i + Lk - Lq`` (a cache's new tokens are its
last positions).

Example:
    >>> import numpy as np
    >>> import portattn
    >>> from portattn import masks, scores
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 8, 4)) for _ in range(3))
    >>> table = rng.standard_normal((32, 2))  # (num_buckets, heads): T5's embedding
    >>> change = scores.relative_position(table, bidirectional=False, max_distance=128)
    >>> out = portattn.attention(q, k, v, mask=masks.causal(), score_mod=change)
    >>> dense = change.dense(8, 8)  # the same entries, as an array (for checks)
    >>> same = portattn.attention(q, k, v, mask=masks.causal(), bias=dense)
    >>> bool(np.allclose(out, same))
    True
"""

from __future__ import annotations

import math
from typing import Any

from ._lib import check_beside, dtype_name, namespace_name, to_host, values_readable, vjp

__all__ = ["ADDITIVE_KINDS", "KINDS", "ScoreChange", "alibi", "function", "pair_table",
           "relative_position", "show", "softcap", "t5_buckets", "window_table"]


#: The kinds of change that add entries from tables, by the functions that make them.
ADDITIVE_KINDS = frozenset({"relative_position", "window_table", "alibi", "pair_table"})
#: Every kind, those that add and those that map each score.
KINDS = ADDITIVE_KINDS | {"function", "softcap"}


class ScoreChange:
    """A score change: entries per (batch, head, query, key) computed from
    :attr:`arrays`, tile by tile.

    Kinds implement :meth:`entries` and :meth:`table_gradients`; :meth:`bind` checks a
    change against a call. ``a + b`` adds two changes.
    """

    #: The arrays the change reads; each gets a gradient where :attr:`trainable` says so.
    arrays: tuple[Any, ...] = ()
    #: Per array of :attr:`arrays`: whether it gets a gradient (tables do, indices not).
    trainable: tuple[bool, ...] = ()
    #: Whether the change adds :meth:`entries` to the scores (the tables and their sums);
    #: a change that maps each score (:func:`function`, :func:`softcap`) says False.
    additive: bool = True
    #: Its kind, one of :data:`KINDS` (the name of the function that makes it).
    kind: str = ""

    @property
    def kinds(self) -> frozenset[str]:
        """The kinds it is made of (a sum's are its parts'): what a kernel that takes
        some kinds only (``Kernel.score_mod``) checks."""
        return frozenset({self.kind})

    def with_arrays(self, arrays: tuple[Any, ...]) -> ScoreChange:
        """The same change reading ``arrays`` (as many as :attr:`arrays`, in order):
        how a library's autograd passes the arrays it tracks."""
        raise NotImplementedError

    def bind(self, xp: Any, device: Any, batch: tuple[int, ...], heads: int,
             q_len: int, kv_len: int) -> ScoreChange:
        """The change checked against a call (its library, device and shape).

        Raises:
            TypeError: an array of another library, or of the wrong dtype.
            ValueError: shapes that do not fit the call, or values out of range.
        """
        raise NotImplementedError

    def entries(self, xp: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
                kv_len: int, rank: int) -> Any:
        """The entries of queries ``q0:q1`` and keys ``k0:k1``, shaped
        ``(*batch | 1, Hq, q1 - q0, k1 - k0)`` with ``rank`` dims (batch axes 1 where
        they do not vary), in the table's dtype."""
        raise NotImplementedError

    def table_gradients(self, xp: Any, ds: Any, q0: int, q1: int, k0: int, k1: int,
                        q_len: int, kv_len: int, dtype: Any) -> tuple[Any, ...]:
        """Each array's gradient from the score gradient ``ds`` ``(*batch, Hq, tq, tk)``
        of one tile, in ``dtype`` (None for an array that gets none)."""
        raise NotImplementedError

    def by_distance(self, xp: Any, q_len: int, kv_len: int) -> Any:
        """None, or the entries as a function of the distance alone: ``(Hq, Lq + Lk -
        1)``, the entry of query ``i`` and key ``j`` at ``j - i + Lq - 1`` (T5's
        buckets, ALiBi and their sums): what a kernel spreads over a tile's diagonals."""
        return None

    def distance_gradients(self, xp: Any, g: Any, q_len: int, kv_len: int,
                           dtype: Any) -> tuple[Any, ...]:
        """:meth:`table_gradients` from ``g``, the gradient of the :meth:`by_distance`
        array ``(Hq, Lq + Lk - 1)`` (summed over the batch), in ``dtype``."""
        raise NotImplementedError

    def dense(self, q_len: int, kv_len: int) -> Any:
        """Every entry at once, ``(*batch | 1, Hq, Lq, Lk)``, in the library of the
        tables: for checks and drawings, not for kernels (it is the ``Lq x Lk`` array
        they avoid)."""
        from array_api_compat import array_namespace

        if not self.additive:
            msg = f"{self!r} maps each score: it has no entries of its own to show"
            raise TypeError(msg)
        xp = array_namespace(*self.arrays)
        return self.entries(xp, 0, q_len, 0, kv_len, q_len, kv_len, self.rank)

    @property
    def rank(self) -> int:
        """The rank of :meth:`entries` this change needs at least: its batch axes + 3."""
        return 3

    def __add__(self, other: ScoreChange) -> ScoreChange:
        if not isinstance(other, ScoreChange):
            return NotImplemented
        for change in (self, other):
            if not change.additive:
                msg = (f"{change!r} maps each score, it adds no entries: it cannot be "
                       "summed with another change; write one score function that does "
                       "both (it may read the tables)")
                raise TypeError(msg)
        return _Sum(self, other)

    # Changes that map each score (``additive`` False) implement these two instead of
    # entries and table_gradients, and hold the map as a score function ``fn(score, b,
    # h, q_idx, kv_idx, *arrays)`` (what FlexAttention's score_mod is).

    def apply(self, xp: Any, s: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
        """The scores ``s`` ``(*batch, Hq, q1 - q0, k1 - k0)`` of queries ``q0:q1`` and
        keys ``k0:k1``, changed."""
        raise NotImplementedError

    def score_gradients(self, xp: Any, s: Any, ds: Any, q0: int, q1: int, k0: int, k1: int,
                        dtype: Any) -> tuple[Any, tuple[Any, ...]]:
        """From ``ds``, the gradient of :meth:`apply`'s result at ``s``: the gradient of
        ``s`` and each array's (in ``dtype``; None for an array that gets none)."""
        raise NotImplementedError


def t5_buckets(xp: Any, relative: Any, *, bidirectional: bool, num_buckets: int,
               max_distance: int) -> Any:
    """T5's bucket of each relative position ``key - query`` (an integer array).

    Bidirectional, keys before the query take the lower half of the buckets and keys
    after it the upper half; one-directional, keys before it take them all and keys
    after it fall in bucket 0 (a causal mask hides them). In each such range the first
    half of the buckets hold one distance each, the rest distances growing
    logarithmically up to ``max_distance``, from which all share the last bucket.
    The logarithm is taken in float32, as T5's implementations do, so a table trained
    with them meets the same bucket at every distance.

    Example:
        >>> import numpy as np
        >>> from portattn.scores import t5_buckets
        >>> t5_buckets(np, np.array([-200, -20, -3, 0, 3, 20]), bidirectional=True,
        ...            num_buckets=32, max_distance=128).tolist()
        [15, 10, 3, 0, 19, 26]
    """
    n = num_buckets
    zero = xp.zeros_like(relative)
    if bidirectional:
        n //= 2
        base = xp.where(relative > 0, zero + n, zero)
        distance = xp.abs(relative)
    else:
        base = zero
        distance = xp.maximum(-relative, zero)
    exact = n // 2
    # the log of distances >= exact only (the others are exact buckets): no log(0)
    far = xp.astype(xp.maximum(distance, zero + exact), xp.float32)
    growth = xp.log(far / exact) / math.log(max_distance / exact) * (n - exact)
    large = xp.minimum(exact + xp.astype(growth, relative.dtype), zero + (n - 1))
    return base + xp.where(distance < exact, distance, large)


class _PositionTable(ScoreChange):
    """``table[index(i, j), h]``: an entry per head for each pair, the index read from
    the two positions alone (T5's buckets, Swin's offsets)."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.arrays = (table,)
        self.trainable = (True,)

    def index(self, xp: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
              kv_len: int) -> Any:
        """The table row of each pair of the tile, ``(q1 - q0, k1 - k0)``."""
        raise NotImplementedError

    def check(self, q_len: int, kv_len: int) -> None:
        """Refuse a call whose lengths the index cannot take."""

    def bind(self, xp: Any, device: Any, batch: tuple[int, ...], heads: int,
             q_len: int, kv_len: int) -> ScoreChange:
        what = f"{self.name} table"
        _check_table(xp, device, self.table, what)
        shape = tuple(self.table.shape)
        if len(shape) != 2 or shape[1] != heads:
            msg = (f"{what} must have shape ({self.rows}, Hq) = ({self.rows}, {heads}); "
                   f"got table.shape={shape}")
            raise ValueError(msg)
        self.check(q_len, kv_len)
        return self

    def entries(self, xp: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
                kv_len: int, rank: int) -> Any:
        rows = self.index(xp, q0, q1, k0, k1, q_len, kv_len)
        tq, tk = rows.shape
        taken = xp.take(self.table, xp.reshape(rows, (-1,)), axis=0)  # (tq * tk, H)
        per_head = xp.permute_dims(xp.reshape(taken, (tq, tk, -1)), (2, 0, 1))
        return xp.reshape(per_head, (1,) * (rank - 3) + tuple(per_head.shape))

    def table_gradients(self, xp: Any, ds: Any, q0: int, q1: int, k0: int, k1: int,
                        q_len: int, kv_len: int, dtype: Any) -> tuple[Any, ...]:
        heads, tq, tk = ds.shape[-3:]
        per_head = xp.reshape(_summed_over_batch(xp, ds), (heads, tq * tk))
        rows = self.index(xp, q0, q1, k0, k1, q_len, kv_len)
        one_hot = _one_hot(xp, xp.reshape(rows, (-1,)), self.table.shape[0], dtype)
        # a product, not a scatter: the same sums in the same order on every run
        return (xp.permute_dims(xp.matmul(xp.astype(per_head, dtype), one_hot), (1, 0)),)


class _RelativePosition(_PositionTable):
    name, rows = "relative_position", "num_buckets"
    kind = "relative_position"

    def __init__(self, table: Any, bidirectional: bool, max_distance: int,
                 bound: bool = False) -> None:
        super().__init__(table)
        self.bidirectional = bidirectional
        self.max_distance = max_distance
        # Bound to one call (its lengths and tables fixed): what every tile reads is
        # made once, on first use. A change as the caller holds it keeps nothing: its
        # table may be trained in place between calls.
        self._memo: dict[Any, Any] | None = {} if bound else None

    def __repr__(self) -> str:
        return (f"relative_position(table{tuple(self.table.shape)}, "
                f"bidirectional={self.bidirectional}, max_distance={self.max_distance})")

    def with_arrays(self, arrays: tuple[Any, ...]) -> ScoreChange:
        return _RelativePosition(arrays[0], self.bidirectional, self.max_distance,
                                 bound=self._memo is not None)

    def bind(self, xp: Any, device: Any, batch: tuple[int, ...], heads: int,
             q_len: int, kv_len: int) -> ScoreChange:
        super().bind(xp, device, batch, heads, q_len, kv_len)
        return _RelativePosition(self.table, self.bidirectional, self.max_distance, bound=True)

    # The entries depend on the distance k - q alone. The call's Lq + Lk - 1 distances
    # are bucketed and looked up once; a tile reads its tq + tk - 1 of them and spreads
    # them over its diagonals, and its score gradient is summed along its diagonals
    # before it meets the buckets.

    def _made(self, key: tuple[Any, ...], make: Any) -> Any:
        if self._memo is None:
            return make()
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def _buckets(self, xp: Any, q_len: int, kv_len: int) -> Any:
        """The buckets of the call's distances, from ``-(Lk - 1)`` up to ``Lq - 1``."""
        def make() -> Any:
            distances = xp.arange(-(kv_len - 1), q_len, dtype=xp.int32,
                                  device=_device(self.table))
            return t5_buckets(xp, distances, bidirectional=self.bidirectional,
                              num_buckets=self.table.shape[0], max_distance=self.max_distance)
        return self._made(("buckets", q_len, kv_len), make)

    def by_distance(self, xp: Any, q_len: int, kv_len: int) -> Any:
        return self._made(("entries", q_len, kv_len), lambda: xp.permute_dims(
            xp.take(self.table, self._buckets(xp, q_len, kv_len), axis=0), (1, 0)))

    def entries(self, xp: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
                kv_len: int, rank: int) -> Any:
        return _spread(xp, self.by_distance(xp, q_len, kv_len), q0, q1, k0, k1, q_len, rank)

    def table_gradients(self, xp: Any, ds: Any, q0: int, q1: int, k0: int, k1: int,
                        q_len: int, kv_len: int, dtype: Any) -> tuple[Any, ...]:
        per_distance = _diagonal_sums(xp, xp.astype(_summed_over_batch(xp, ds), dtype))
        first = k0 - q1 + q_len
        part = self._one_hot(xp, q_len, kv_len, dtype)[first:first + per_distance.shape[-1], :]
        return (xp.permute_dims(xp.matmul(per_distance, part), (1, 0)),)

    def distance_gradients(self, xp: Any, g: Any, q_len: int, kv_len: int,
                           dtype: Any) -> tuple[Any, ...]:
        one_hot = self._one_hot(xp, q_len, kv_len, dtype)
        return (xp.permute_dims(xp.matmul(xp.astype(g, dtype), one_hot), (1, 0)),)

    def _one_hot(self, xp: Any, q_len: int, kv_len: int, dtype: Any) -> Any:
        """``(Lq + Lk - 1, num_buckets)``: each distance's bucket, one-hot."""
        return self._made(("one hot", q_len, kv_len, dtype_name(dtype)), lambda: _one_hot(
            xp, self._buckets(xp, q_len, kv_len), self.table.shape[0], dtype))


class _WindowTable(_PositionTable):
    name, rows = "window_table", "(2 * Wh - 1) * (2 * Ww - 1)"
    kind = "window_table"

    def __init__(self, table: Any, window: tuple[int, int]) -> None:
        super().__init__(table)
        self.window = window

    def __repr__(self) -> str:
        return f"window_table(table{tuple(self.table.shape)}, window={self.window})"

    def with_arrays(self, arrays: tuple[Any, ...]) -> ScoreChange:
        return _WindowTable(arrays[0], self.window)

    def bind(self, xp: Any, device: Any, batch: tuple[int, ...], heads: int,
             q_len: int, kv_len: int) -> ScoreChange:
        height, width = self.window
        rows = (2 * height - 1) * (2 * width - 1)
        got = getattr(self.table, "shape", (None,))[0]
        if got != rows:
            msg = (f"window_table table must have (2 * Wh - 1) * (2 * Ww - 1) = {rows} rows "
                   f"for window={self.window}; got table.shape[0]={got}")
            raise ValueError(msg)
        return super().bind(xp, device, batch, heads, q_len, kv_len)

    def check(self, q_len: int, kv_len: int) -> None:
        tokens = self.window[0] * self.window[1]
        if q_len != tokens or kv_len != tokens:
            msg = (f"window_table with window={self.window} needs Lq = Lk = Wh * Ww = "
                   f"{tokens} (one window's tokens, row by row); got Lq={q_len}, Lk={kv_len}")
            raise ValueError(msg)

    def index(self, xp: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
              kv_len: int) -> Any:
        queries, keys = _positions(xp, self.table, q0, q1, k0, k1, q_len, kv_len)
        width = self.window[1]
        rows = queries[:, None] // width - keys[None, :] // width + (self.window[0] - 1)
        cols = queries[:, None] % width - keys[None, :] % width + (width - 1)
        return rows * (2 * width - 1) + cols


class _Slopes(ScoreChange):
    """ALiBi with learned slopes: ``-slope[h] * |i + Lk - Lq - j|``."""

    kind = "alibi"

    def __init__(self, slopes: Any) -> None:
        self.slopes = slopes
        self.arrays = (slopes,)
        self.trainable = (True,)

    def __repr__(self) -> str:
        return f"alibi(slopes{tuple(self.slopes.shape)})"

    def with_arrays(self, arrays: tuple[Any, ...]) -> ScoreChange:
        return _Slopes(arrays[0])

    def bind(self, xp: Any, device: Any, batch: tuple[int, ...], heads: int,
             q_len: int, kv_len: int) -> ScoreChange:
        _check_table(xp, device, self.slopes, "alibi slopes")
        if tuple(self.slopes.shape) != (heads,):
            msg = (f"alibi slopes must have shape (Hq,) = ({heads},); got "
                   f"slopes.shape={tuple(self.slopes.shape)}")
            raise ValueError(msg)
        return self

    def distances(self, xp: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
                  kv_len: int, dtype: Any) -> Any:
        queries, keys = _positions(xp, self.slopes, q0, q1, k0, k1, q_len, kv_len)
        return xp.astype(xp.abs(queries[:, None] - keys[None, :]), dtype)

    def entries(self, xp: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
                kv_len: int, rank: int) -> Any:
        distance = self.distances(xp, q0, q1, k0, k1, q_len, kv_len, self.slopes.dtype)
        per_head = -self.slopes[:, None, None] * distance[None, :, :]
        return xp.reshape(per_head, (1,) * (rank - 3) + tuple(per_head.shape))

    def table_gradients(self, xp: Any, ds: Any, q0: int, q1: int, k0: int, k1: int,
                        q_len: int, kv_len: int, dtype: Any) -> tuple[Any, ...]:
        distance = self.distances(xp, q0, q1, k0, k1, q_len, kv_len, dtype)
        weighted = xp.astype(_summed_over_batch(xp, ds), dtype) * distance[None, :, :]
        return (-xp.sum(weighted, axis=(-2, -1)),)

    def _distances(self, xp: Any, q_len: int, kv_len: int, dtype: Any) -> Any:
        """``|Lk - 1 - d|`` for each ``d`` of :meth:`by_distance`."""
        d = xp.arange(q_len + kv_len - 1, dtype=xp.int32, device=_device(self.slopes))
        return xp.astype(xp.abs(kv_len - 1 - d), dtype)

    def by_distance(self, xp: Any, q_len: int, kv_len: int) -> Any:
        distance = self._distances(xp, q_len, kv_len, self.slopes.dtype)
        return -self.slopes[:, None] * distance[None, :]

    def distance_gradients(self, xp: Any, g: Any, q_len: int, kv_len: int,
                           dtype: Any) -> tuple[Any, ...]:
        distance = self._distances(xp, q_len, kv_len, dtype)
        return (-xp.sum(xp.astype(g, dtype) * distance[None, :], axis=-1),)


class _PairTable(ScoreChange):
    kind = "pair_table"

    def __init__(self, table: Any, query_classes: Any, key_classes: Any) -> None:
        self.table = table
        self.query_classes = query_classes
        self.key_classes = key_classes
        self.arrays = (table, query_classes, key_classes)
        self.trainable = (True, False, False)

    def __repr__(self) -> str:
        return (f"pair_table(table{tuple(self.table.shape)}, "
                f"query_classes{tuple(self.query_classes.shape)}, "
                f"key_classes{tuple(self.key_classes.shape)})")

    def with_arrays(self, arrays: tuple[Any, ...]) -> ScoreChange:
        return _PairTable(*arrays)

    @property
    def rank(self) -> int:
        return self.query_classes.ndim + 2

    def bind(self, xp: Any, device: Any, batch: tuple[int, ...], heads: int,
             q_len: int, kv_len: int) -> ScoreChange:
        _check_table(xp, device, self.table, "pair_table table")
        shape = tuple(self.table.shape)
        if len(shape) != 3 or shape[2] != heads:
            msg = ("pair_table table must have shape (query classes, key classes, Hq) = "
                   f"(Cq, Ck, {heads}); got table.shape={shape}")
            raise ValueError(msg)
        classes = []
        for name, a, length, count in (("query_classes", self.query_classes, q_len, shape[0]),
                                       ("key_classes", self.key_classes, kv_len, shape[1])):
            check_beside(xp, device, a, f"pair_table {name}")
            if not xp.isdtype(a.dtype, "integral"):
                msg = (f"pair_table {name} must be integers; got "
                       f"{name}.dtype={dtype_name(a.dtype)}")
                raise TypeError(msg)
            got = tuple(a.shape)
            fits = (len(got) - 1 <= len(batch) and got[-1:] == (length,) and all(
                s in (1, t) for s, t in zip(got[-2::-1], batch[::-1], strict=False)))
            if not fits:
                msg = (f"pair_table {name} must have shape (*batch, L) = "
                       f"{(*batch, length)} (batch axes may be 1 or left out); got "
                       f"{name}.shape={got}")
                raise ValueError(msg)
            if values_readable(a) and a.shape[-1]:  # a compiler's trace is not checked
                seen = to_host(a)
                if seen.min() < 0 or seen.max() >= count:
                    msg = (f"pair_table {name} must lie in [0, {count}) (the table's "
                           f"classes); got values from {seen.min()} to {seen.max()}")
                    raise ValueError(msg)
            a = xp.reshape(a, (1,) * (len(batch) + 1 - len(got)) + got)
            classes.append(a)
        return _PairTable(self.table, *classes)

    def entries(self, xp: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
                kv_len: int, rank: int) -> Any:
        cq, ck, heads = self.table.shape
        rows = self.query_classes[..., q0:q1]
        cols = self.key_classes[..., k0:k1]
        index = rows[..., :, None] * ck + cols[..., None, :]  # (*b, tq, tk)
        flat = xp.reshape(self.table, (cq * ck, heads))
        taken = xp.take(flat, xp.reshape(index, (-1,)), axis=0)
        entries = xp.reshape(taken, (*index.shape, heads))
        n = entries.ndim
        entries = xp.permute_dims(entries, (*range(n - 3), n - 1, n - 3, n - 2))
        return xp.reshape(entries, (1,) * (rank - entries.ndim) + tuple(entries.shape))

    def table_gradients(self, xp: Any, ds: Any, q0: int, q1: int, k0: int, k1: int,
                        q_len: int, kv_len: int, dtype: Any) -> tuple[Any, ...]:
        cq, ck, _ = self.table.shape
        rows = _one_hot(xp, self.query_classes[..., q0:q1], cq, dtype)  # (*b, tq, Cq)
        cols = _one_hot(xp, self.key_classes[..., k0:k1], ck, dtype)  # (*b, tk, Ck)
        # (*b, 1, Cq, tq) @ (*b, H, tq, tk) @ (*b, 1, tk, Ck): products, no scatter
        per_pair = xp.matmul(xp.matmul(_transposed(xp, rows)[..., None, :, :],
                                       xp.astype(ds, dtype)), cols[..., None, :, :])
        total = _summed_over_batch(xp, per_pair)  # (H, Cq, Ck)
        return (xp.permute_dims(total, (1, 2, 0)), None, None)


class _Sum(ScoreChange):
    def __init__(self, first: ScoreChange, second: ScoreChange) -> None:
        self.parts = (first, second)
        self.arrays = first.arrays + second.arrays
        self.trainable = first.trainable + second.trainable

    @property
    def kinds(self) -> frozenset[str]:
        return self.parts[0].kinds | self.parts[1].kinds

    def __repr__(self) -> str:
        return f"({self.parts[0]!r} + {self.parts[1]!r})"

    @property
    def rank(self) -> int:
        return max(p.rank for p in self.parts)

    def with_arrays(self, arrays: tuple[Any, ...]) -> ScoreChange:
        first, second = self.parts
        n = len(first.arrays)
        return _Sum(first.with_arrays(arrays[:n]), second.with_arrays(arrays[n:]))

    def bind(self, xp: Any, device: Any, batch: tuple[int, ...], heads: int,
             q_len: int, kv_len: int) -> ScoreChange:
        first, second = (p.bind(xp, device, batch, heads, q_len, kv_len) for p in self.parts)
        return _Sum(first, second)

    def entries(self, xp: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
                kv_len: int, rank: int) -> Any:
        return _wide_sum(xp, *(p.entries(xp, q0, q1, k0, k1, q_len, kv_len, rank)
                               for p in self.parts))

    def table_gradients(self, xp: Any, ds: Any, q0: int, q1: int, k0: int, k1: int,
                        q_len: int, kv_len: int, dtype: Any) -> tuple[Any, ...]:
        return tuple(g for p in self.parts
                     for g in p.table_gradients(xp, ds, q0, q1, k0, k1, q_len, kv_len, dtype))

    def by_distance(self, xp: Any, q_len: int, kv_len: int) -> Any:
        first, second = (p.by_distance(xp, q_len, kv_len) for p in self.parts)
        if first is None or second is None:
            return None
        return _wide_sum(xp, first, second)

    def distance_gradients(self, xp: Any, g: Any, q_len: int, kv_len: int,
                           dtype: Any) -> tuple[Any, ...]:
        return tuple(t for p in self.parts
                     for t in p.distance_gradients(xp, g, q_len, kv_len, dtype))


class _Function(ScoreChange):
    """``fn(score, b, h, q_idx, kv_idx, *args)``, as :func:`function` describes."""

    additive, kind = False, "function"

    def __init__(self, fn: Any, args: tuple[Any, ...], trainable: tuple[bool, ...],
                 shape: tuple[tuple[int, ...], int] | None = None) -> None:
        self.fn = fn
        self.arrays = args
        self.trainable = trainable
        self.shape = shape  # the call's (batch, heads), once bound

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        args = ", ".join(f"shape={tuple(a.shape)}" for a in self.arrays)
        return f"function({name}" + (f", args=({args})" if args else "") + ")"

    def with_arrays(self, arrays: tuple[Any, ...]) -> ScoreChange:
        return _Function(self.fn, tuple(arrays), self.trainable, self.shape)

    def bind(self, xp: Any, device: Any, batch: tuple[int, ...], heads: int,
             q_len: int, kv_len: int) -> ScoreChange:
        for n, a in enumerate(self.arrays):
            check_beside(xp, device, a, f"score function args[{n}]")
        bound = _Function(self.fn, self.arrays, self.trainable, (tuple(batch), heads))
        if q_len and kv_len and namespace_name(xp) != "dask":  # a clear error now
            probe = xp.zeros((*batch, heads, 1, 1), dtype=xp.float32, device=device)
            out = bound._call(xp, probe, self.arrays, 0, 1, 0, 1)
            try:
                floating = xp.isdtype(out.dtype, "real floating")
            except TypeError:  # NumPy's isdtype refuses ml_dtypes' bfloat16
                floating = True
            if not floating:
                msg = (f"a score function must return floating scores; got "
                       f"dtype={dtype_name(out.dtype)} from {self!r}")
                raise TypeError(msg)
        return bound

    def _call(self, xp: Any, s: Any, args: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
        batch, heads = self.shape
        device = _device(s)
        b = xp.reshape(xp.arange(math.prod(batch), device=device), (*batch, 1, 1, 1))
        h = xp.reshape(xp.arange(heads, device=device), (heads, 1, 1))
        q = xp.arange(q0, q1, device=device)[:, None]
        k = xp.arange(k0, k1, device=device)[None, :]
        out = self.fn(s, b, h, q, k, *args)
        if not hasattr(out, "shape"):
            out = xp.asarray(out, device=device)
        try:
            return xp.broadcast_to(out, tuple(s.shape))
        except (ValueError, RuntimeError, TypeError) as err:
            msg = (f"a score function must return scores that broadcast to the tile's "
                   f"{tuple(s.shape)}; got shape {tuple(out.shape)} from {self!r}")
            raise ValueError(msg) from err

    def apply(self, xp: Any, s: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
        out = self._call(xp, s, self.arrays, q0, q1, k0, k1)
        return out if out.dtype == s.dtype else xp.astype(out, s.dtype)

    def score_gradients(self, xp: Any, s: Any, ds: Any, q0: int, q1: int, k0: int, k1: int,
                        dtype: Any) -> tuple[Any, tuple[Any, ...]]:
        trained = [n for n, t in enumerate(self.trainable) if t]

        def change(s: Any, *tables: Any) -> Any:
            args = list(self.arrays)
            for n, table in zip(trained, tables, strict=True):
                args[n] = table
            out = self._call(xp, s, args, q0, q1, k0, k1)
            return out if out.dtype == s.dtype else xp.astype(out, s.dtype)

        ds_in, *tables = vjp(xp, change, (s, *(self.arrays[n] for n in trained)), ds)
        grads: list[Any] = [None] * len(self.arrays)
        for n, g in zip(trained, tables, strict=True):
            grads[n] = xp.astype(g, dtype)
        return ds_in, tuple(grads)


class _Softcap(ScoreChange):
    """``cap * tanh(score / cap)`` with a cap that gets a gradient."""

    additive, kind = False, "softcap"

    def __init__(self, cap: Any) -> None:
        self.cap = cap
        self.arrays = (cap,)
        self.trainable = (True,)

    def __repr__(self) -> str:
        return f"softcap(cap{tuple(self.cap.shape)})"

    @staticmethod
    def fn(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, cap: Any) -> Any:
        """The change as a score function (what FlexAttention takes)."""
        per_head = cap if cap.ndim == 0 else cap[h]
        x = score / per_head
        if hasattr(x, "tanh"):  # torch: no namespace lookup inside a compiled score_mod
            return per_head * x.tanh()
        from array_api_compat import array_namespace

        return per_head * array_namespace(x).tanh(x)

    def with_arrays(self, arrays: tuple[Any, ...]) -> ScoreChange:
        return _Softcap(arrays[0])

    def bind(self, xp: Any, device: Any, batch: tuple[int, ...], heads: int,
             q_len: int, kv_len: int) -> ScoreChange:
        _check_table(xp, device, self.cap, "softcap cap")
        if tuple(self.cap.shape) not in ((), (heads,)):
            msg = (f"softcap cap must have shape () or (Hq,) = ({heads},); got "
                   f"cap.shape={tuple(self.cap.shape)}")
            raise ValueError(msg)
        if values_readable(self.cap) and not bool(xp.all(self.cap > 0)):
            msg = f"softcap cap must be positive; got cap={to_host(self.cap).tolist()}"
            raise ValueError(msg)
        return self

    def _per_head(self, xp: Any, dtype: Any) -> Any:
        cap = xp.astype(self.cap, dtype) if self.cap.dtype != dtype else self.cap
        return cap if cap.ndim == 0 else cap[:, None, None]

    def apply(self, xp: Any, s: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
        cap = self._per_head(xp, s.dtype)
        return cap * xp.tanh(s / cap)

    def score_gradients(self, xp: Any, s: Any, ds: Any, q0: int, q1: int, k0: int, k1: int,
                        dtype: Any) -> tuple[Any, tuple[Any, ...]]:
        cap = self._per_head(xp, s.dtype)
        x = s / cap
        t = xp.tanh(x)
        slope = 1 - t * t
        # d(c tanh(s / c)) / dc = tanh(x) - x (1 - tanh(x)^2), x = s / c
        per_pair = xp.astype(ds * (t - x * slope), dtype)
        axes = tuple(range(per_pair.ndim)) if self.cap.ndim == 0 else (
            *range(per_pair.ndim - 3), per_pair.ndim - 2, per_pair.ndim - 1)
        return ds * slope, (xp.sum(per_pair, axis=axes),)


def function(fn: Any, args: tuple[Any, ...] = ()) -> ScoreChange:
    """A score function: the score of query ``q_idx`` and key ``kv_idx`` becomes
    ``fn(score, b, h, q_idx, kv_idx, *args)``, FlexAttention's ``score_mod``.

    ``b`` is the flat batch index, ``h`` the query head, ``q_idx`` and ``kv_idx`` the
    query and key indices of the call (as :func:`portattn.masks.function` sees them):
    integer arrays of the call's library that broadcast against ``score`` (a tile of
    scores). Write ``fn`` with operators and the library's functions, elementwise in
    ``score``. It runs where a score change joins (after ``scale``, ``softcap``,
    ``bias`` and ALiBi, before the mask).

    Args:
        fn: The function; it returns the new scores.
        args: Arrays ``fn`` reads, of the call's library and device. Floating ones get
            gradients, computed tile by tile by the library's autodiff (torch, JAX).

    Returns:
        A :class:`ScoreChange` for ``score_mod``. Only kernels with
        ``Kernel.score_functions`` take it; it cannot be summed with another change.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import scores
        >>> rng = np.random.default_rng(0)
        >>> q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
        >>> bias = rng.standard_normal((2, 7))  # per head, per distance k - q + 3
        >>> def shifted(score, b, h, q_idx, kv_idx, bias):
        ...     return score + bias[h, kv_idx - q_idx + 3]
        >>> out = portattn.attention(q, k, v, score_mod=scores.function(shifted, (bias,)))
        >>> i, j = np.arange(4)[:, None], np.arange(4)[None, :]
        >>> same = portattn.attention(q, k, v, bias=bias[:, j - i + 3][None])
        >>> bool(np.allclose(out, same))
        True
    """
    if not callable(fn):
        msg = f"function expects a callable fn(score, b, h, q_idx, kv_idx, *args); got {fn!r}"
        raise TypeError(msg)
    if not isinstance(args, (tuple, list)):
        msg = (f"function args must be a tuple of arrays fn reads; got args of type "
               f"{type(args).__name__}")
        raise TypeError(msg)
    for n, a in enumerate(args):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            msg = f"function args[{n}] must be an array; got {type(a).__name__}"
            raise TypeError(msg)
    return _Function(fn, tuple(args), tuple(_floating(a) for a in args))


def softcap(cap: Any) -> ScoreChange:
    """Tanh soft-capping with a cap the model learns: each score becomes
    ``cap * tanh(score / cap)``, where a score change joins (the ``softcap=`` argument
    takes a constant and caps before ``bias`` and ALiBi).

    Args:
        cap: ``()`` or ``(Hq,)``, floating and positive. Gets a gradient.

    Returns:
        A :class:`ScoreChange` for ``score_mod`` (``Kernel.score_functions`` kernels).

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import scores
        >>> rng = np.random.default_rng(0)
        >>> q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
        >>> out = portattn.attention(q, k, v, score_mod=scores.softcap(np.asarray(5.0)))
        >>> same = portattn.attention(q, k, v, softcap=5.0)
        >>> bool(np.allclose(out, same))
        True
    """
    return _Softcap(cap)


def relative_position(table: Any, *, bidirectional: bool = True,
                      max_distance: int = 128) -> ScoreChange:
    """T5's relative-position bias: ``table[bucket(j - i), h]`` joins the score of query
    ``i`` and key ``j`` in head ``h`` (:func:`t5_buckets`).

    Args:
        table: ``(num_buckets, Hq)``, floating: T5's ``relative_attention_bias.weight``
            as it is. Gets a gradient.
        bidirectional: T5's encoder (True) or decoder (False) bucketing.
        max_distance: the distance from which all keys share the last bucket.

    Returns:
        A :class:`ScoreChange` for ``score_mod``.

    Raises:
        ValueError: fewer buckets than the bucketing needs, or a ``max_distance`` not
            past the exact buckets.

    Example:
        >>> import numpy as np
        >>> from portattn import scores
        >>> change = scores.relative_position(np.zeros((32, 8)), bidirectional=True)
        >>> change.dense(4, 6).shape
        (8, 4, 6)
    """
    buckets = getattr(table, "shape", (0,))[0] if getattr(table, "ndim", 0) >= 1 else 0
    exact = (buckets // 2 if bidirectional else buckets) // 2
    if exact < 1:
        msg = (f"relative_position needs at least {4 if bidirectional else 2} buckets "
               f"(table.shape[0]); got {buckets}")
        raise ValueError(msg)
    if not isinstance(max_distance, int) or isinstance(max_distance, bool) or (
            max_distance <= exact):
        msg = (f"max_distance must be an int above the exact buckets ({exact}); got "
               f"max_distance={max_distance!r}")
        raise ValueError(msg)
    return _RelativePosition(table, bool(bidirectional), max_distance)


def window_table(table: Any, window: tuple[int, int]) -> ScoreChange:
    """Swin's relative-position bias inside a window of ``Wh x Ww`` tokens (held row by
    row, ``Lq = Lk = Wh * Ww``): ``table[(dy + Wh - 1) * (2 * Ww - 1) + dx + Ww - 1, h]``
    joins the score of two tokens ``dy`` rows and ``dx`` columns apart.

    Args:
        table: ``((2 * Wh - 1) * (2 * Ww - 1), Hq)``, floating: Swin's
            ``relative_position_bias_table`` as it is. Gets a gradient.
        window: ``(Wh, Ww)``.

    Returns:
        A :class:`ScoreChange` for ``score_mod`` (windows are the batch axes).

    Example:
        >>> import numpy as np
        >>> from portattn import scores
        >>> change = scores.window_table(np.arange(9.0)[:, None], (2, 2))
        >>> change.dense(4, 4)[0].tolist()  # the same token: offset (0, 0), row 4
        [[4.0, 3.0, 1.0, 0.0], [5.0, 4.0, 2.0, 1.0], [7.0, 6.0, 4.0, 3.0], [8.0, 7.0, 5.0, 4.0]]
    """
    if (not isinstance(window, tuple) or len(window) != 2 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in window)):
        msg = f"window must be a pair of positive ints (Wh, Ww); got window={window!r}"
        raise ValueError(msg)
    return _WindowTable(table, window)


def alibi(slopes: Any) -> ScoreChange:
    """ALiBi with slopes the model learns: ``-slopes[h] * |i + Lk - Lq - j|`` joins the
    score of query ``i`` and key ``j`` (the distance as ``alibi_slopes`` measures it,
    which takes constant slopes only).

    Args:
        slopes: ``(Hq,)``, floating. Gets a gradient.

    Returns:
        A :class:`ScoreChange` for ``score_mod``.

    Example:
        >>> import numpy as np
        >>> from portattn import scores
        >>> scores.alibi(np.array([0.5])).dense(2, 3)[0].tolist()
        [[-0.5, -0.0, -0.5], [-1.0, -0.5, -0.0]]
    """
    return _Slopes(slopes)


def pair_table(table: Any, query_classes: Any, key_classes: Any) -> ScoreChange:
    """A pair bias gathered from a learned table: ``table[cq[b, i], ck[b, j], h]`` joins
    the score of query ``i`` and key ``j`` (token types, residue or atom classes).

    Args:
        table: ``(Cq, Ck, Hq)``, floating. Gets a gradient.
        query_classes: integers ``(*batch, Lq)`` in ``[0, Cq)`` (batch axes may be 1 or
            left out).
        key_classes: integers ``(*batch, Lk)`` in ``[0, Ck)``.

    Returns:
        A :class:`ScoreChange` for ``score_mod``.

    Example:
        >>> import numpy as np
        >>> from portattn import scores
        >>> table = np.arange(2 * 2 * 1, dtype=np.float64).reshape(2, 2, 1)
        >>> change = scores.pair_table(table, np.array([[0, 1]]), np.array([[1, 1, 0]]))
        >>> change.dense(2, 3)[0, 0].tolist()
        [[1.0, 1.0, 0.0], [3.0, 3.0, 2.0]]
    """
    return _PairTable(table, query_classes, key_classes)


def show(change: ScoreChange, q_len: int, kv_len: int, *, batch: int = 0, head: int = 0,
         ax: Any = None) -> Any:
    """Draw the entries ``change`` adds to the scores of a call of ``q_len`` queries and
    ``kv_len`` keys, for one batch element and head (a mask is drawn by
    :func:`portattn.masks.show`).

    Args:
        change: A :class:`ScoreChange` (its tables as they are now).
        q_len: Number of queries (``Lq``), at least 1.
        kv_len: Number of keys (``Lk``), at least 1; ``q_len * kv_len`` at most 2**24.
        batch: Flat batch index, for changes that vary per batch element (pair tables);
            any index draws the same picture for those that do not.
        head: Query head.
        ax: A matplotlib Axes to draw on; None makes a new figure.

    Returns:
        The matplotlib Axes drawn on; its first image holds the entries.

    Raises:
        ImportError: matplotlib is not installed (``pip install "portattn[plot]"``).
        ValueError: a length or index out of range, or a change that does not fit.

    Example:
        >>> import numpy as np
        >>> from matplotlib.figure import Figure
        >>> from portattn import scores
        >>> change = scores.relative_position(np.linspace(-1, 1, 32)[:, None] * [1, 2])
        >>> ax = scores.show(change, 48, 48, head=1, ax=Figure().subplots())
        >>> print(ax.get_title())
        relative_position(table(32, 2), bidirectional=True, max_distance=128)
        head 1: entries from -2 to 1.74
    """
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            msg = f"{name} must be an int of at least 1; got {name}={value!r}"
            raise ValueError(msg)
    if q_len * kv_len > 1 << 24:
        msg = f"show draws at most 2**24 pairs; got {q_len}x{kv_len}: draw a shorter call"
        raise ValueError(msg)
    try:
        import matplotlib  # noqa: F401  (is it installed?)
    except ImportError as e:
        msg = 'portattn.scores.show needs matplotlib; install it with pip install "portattn[plot]"'
        raise ImportError(msg) from e
    entries = to_host(change.dense(q_len, kv_len))
    per_batch = entries.reshape(-1, *entries.shape[-3:])
    heads = per_batch.shape[1]
    if not 0 <= head < heads:
        msg = f"head must lie in [0, {heads}); got head={head!r}"
        raise ValueError(msg)
    if not isinstance(batch, int) or batch < 0 or (
            per_batch.shape[0] > 1 and batch >= per_batch.shape[0]):
        msg = f"batch must lie in [0, {per_batch.shape[0]}); got batch={batch!r}"
        raise ValueError(msg)
    drawn = per_batch[min(batch, per_batch.shape[0] - 1), head]
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(6.4, 6.4), layout="constrained")
    reach = float(abs(drawn).max()) or 1.0
    image = ax.imshow(drawn, cmap="RdBu_r", vmin=-reach, vmax=reach, interpolation="nearest")
    ax.figure.colorbar(image, ax=ax, shrink=0.8)
    ax.set_title(f"{change!r}\nhead {head}: entries from {drawn.min():.3g} to "
                 f"{drawn.max():.3g}", fontsize="medium")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    return ax


def _check_table(xp: Any, device: Any, table: Any, what: str) -> None:
    check_beside(xp, device, table, what)
    try:
        floating = xp.isdtype(table.dtype, "real floating")
    except TypeError:  # NumPy's isdtype refuses ml_dtypes' bfloat16
        floating = False
    if not floating:
        msg = f"{what} must have a real floating dtype; got dtype={dtype_name(table.dtype)}"
        raise TypeError(msg)


def _positions(xp: Any, like: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
               kv_len: int) -> tuple[Any, Any]:
    """The aligned positions of a tile's queries and keys (query ``i`` at
    ``i + Lk - Lq``), as int32 arrays on the device of ``like``."""
    offset = kv_len - q_len
    device = _device(like)
    return (xp.arange(q0 + offset, q1 + offset, dtype=xp.int32, device=device),
            xp.arange(k0, k1, dtype=xp.int32, device=device))


def _wide_sum(xp: Any, first: Any, second: Any) -> Any:
    """``first + second``; tables of two dtypes add in the wider."""
    if first.dtype != second.dtype:
        wide = xp.result_type(first.dtype, second.dtype)
        first, second = xp.astype(first, wide), xp.astype(second, wide)
    return first + second


def _spread(xp: Any, per_distance: Any, q0: int, q1: int, k0: int, k1: int, q_len: int,
            rank: int) -> Any:
    """A tile's entries from the call's :meth:`ScoreChange.by_distance` array."""
    tq, tk = q1 - q0, k1 - k0
    first = k0 - q1 + q_len  # the tile's lowest distance, counted from the call's
    spread = _toeplitz(xp, per_distance[:, first:first + tq + tk - 1], tq, tk)
    return xp.reshape(spread, (1,) * (rank - 3) + tuple(spread.shape))


def _toeplitz(xp: Any, per_diagonal: Any, tq: int, tk: int) -> Any:
    """``(H, tq, tk)`` whose entry ``(i, j)`` is ``per_diagonal[:, j - i + tq - 1]``.

    Copies, no gather: the diagonals rotated to start at the main one, repeated
    ``tq`` times end to end and read ``tq + tk - 2`` at a time, shift by one per row."""
    heads, n = per_diagonal.shape
    if tq == 1:
        return xp.reshape(per_diagonal, (heads, 1, tk))
    rotated = xp.concat([per_diagonal[:, tq - 1:], per_diagonal[:, :tq - 1]], axis=1)
    width = n - 1
    rows = xp.reshape(xp.tile(rotated, (1, tq))[:, :tq * width], (heads, tq, width))
    return rows[:, :, :tk]


def _diagonal_sums(xp: Any, x: Any) -> Any:
    """``(H, tq + tk - 1)``: the sums of ``x`` ``(H, tq, tk)`` along its diagonals
    ``j - i + tq - 1``. The rows are reversed and each padded with ``tq`` zeros, so
    that read ``tq + tk - 1`` at a time they fall into columns by diagonal."""
    heads, tq, tk = x.shape
    width = tq + tk - 1
    padded = xp.concat([xp.flip(x, axis=1), xp.zeros((heads, tq, tq), dtype=x.dtype,
                                                     device=_device(x))], axis=2)
    skewed = xp.reshape(padded, (heads, tq * (tk + tq)))[:, :tq * width]
    return xp.sum(xp.reshape(skewed, (heads, tq, width)), axis=1)


def _floating(a: Any) -> bool:
    from array_api_compat import array_namespace

    try:
        return bool(array_namespace(a).isdtype(a.dtype, "real floating"))
    except TypeError:  # NumPy's isdtype refuses ml_dtypes' bfloat16
        return dtype_name(a.dtype) in {"bfloat16", "float16", "float32", "float64"}


def _device(a: Any) -> Any:
    from array_api_compat import device

    return device(a)


def _one_hot(xp: Any, index: Any, count: int, dtype: Any) -> Any:
    """``(*index.shape, count)``: 1 where the last axis equals the index."""
    classes = xp.arange(count, dtype=index.dtype, device=_device(index))
    return xp.astype(index[..., None] == classes, dtype)


def _transposed(xp: Any, x: Any) -> Any:
    n = x.ndim
    return xp.permute_dims(x, (*range(n - 2), n - 1, n - 2))


def _summed_over_batch(xp: Any, x: Any) -> Any:
    """``x`` ``(*batch, H, a, b)`` summed over its batch axes."""
    return xp.sum(x, axis=tuple(range(x.ndim - 3))) if x.ndim > 3 else x
