"""Per-batch lengths: padding on the right of the keys (:class:`KeyLengths`) or the
queries (:class:`QueryLengths`), and the bidirectional prefix of a prefix-LM
(:class:`Prefix`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .._lib import dtype_name, host_copy
from ._base import (
    Aligned,
    Mask,
    along,
    column,
    edges_at_rank,
    per_batch,
    replaced,
    tile_states,
)
from ._values import array_argument, check_bounds, signed

__all__ = ["KeyLengths", "Prefix", "QueryLengths"]


class _Lengths(Mask):
    """One integer per batch element; ``host`` is their copy on the host once bound
    to a call whose values can be read."""

    lengths: Any
    host: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", array_argument(
            self.lengths, self.kind, "an integer array with the batch shape"))

    @property
    def arrays(self):
        return (self.lengths,)

    def with_arrays(self, arrays):
        (lengths,) = arrays
        return replaced(self, lengths=lengths, host=None)

    def _limit(self, lq: int, lk: int) -> tuple[int, str, str] | None:
        """``(limit, name, limit name)`` of the lengths' range ``[0, limit]``."""
        if self.kind == "key_lengths":
            return lk, "key_lengths lengths", "Lk"
        return lq, "query_lengths lengths", "Lq"

    def for_call(self, xp, batch_shape, num_heads, lq, lk, device=None):
        lengths = self.lengths
        if not xp.isdtype(lengths.dtype, "integral"):
            msg = (f"{self.kind} lengths must have an integer dtype; got "
                   f"{self.kind}.dtype={dtype_name(lengths.dtype)}")
            raise TypeError(msg)
        if tuple(lengths.shape) != tuple(batch_shape):
            msg = (f"{self.kind} lengths must have the batch shape of query, "
                   f"{tuple(batch_shape)}; got lengths.shape={tuple(lengths.shape)}")
            raise ValueError(msg)
        lengths = signed(xp, lengths)
        limit = self._limit(lq, lk)
        if limit is not None:
            check_bounds(xp, lengths, *limit, what=self.kind)
        return replaced(self, lengths=lengths, host=host_copy(lengths))

    def lengths_on_host(self) -> Any:
        """The lengths as a NumPy array, read when the mask was bound to its call; None
        when they could not be read (traced, lazy) or it is not bound."""
        return self.host

    def column(self, xp: Any) -> Any:
        """The lengths as ``(*batch, 1, 1, 1)``: broadcasts against ``(*batch, H, tq, tk)``."""
        return column(xp, self.lengths)

    def _host_column(self) -> Any:
        return None if self.host is None else self.host.reshape(*self.host.shape, 1, 1, 1)

    def __repr__(self) -> str:
        return f"{self.kind}(shape={tuple(self.lengths.shape)})"


class _PaddingLengths(_Lengths):
    """Right padding along one axis: positions ``>= lengths[b]`` are padding."""

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        start, stop = (k0, k1) if self.kind == "key_lengths" else (q0, q1)
        # signed first: lengths - start must not wrap around in an unsigned dtype
        # (asarray: NumPy's clip turns a 0-d array into a scalar)
        lengths = xp.asarray(xp.clip(signed(xp, self.lengths) - start, 0, stop - start))
        host = None if self.host is None else (self.host - start).clip(0, stop - start)
        return replaced(self, lengths=lengths, host=host)

    def _states(self, first: Any, last: Any, lengths: Any, xp: Any = None) -> Any:
        """States of blocks ``[first, last]`` along the padded axis, per batch element."""
        return None if lengths is None else tile_states(first >= lengths, last < lengths, xp)

    def array_states(self, grid, xp, rank):
        q_first, q_last, k_first, k_last = edges_at_rank(grid, rank)
        first, last = (k_first, k_last) if self.kind == "key_lengths" else (q_first, q_last)
        return self._states(first, last, self.column(xp), xp)


@dataclass(frozen=True, eq=False, repr=False)
class KeyLengths(_PaddingLengths):
    """Keys ``j >= lengths[b]`` of batch element ``b`` are padding. Made by
    :func:`~portattn.masks.key_lengths`.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> print(masks.text(masks.key_lengths(np.array([3, 6])), 2, 6, batch=0))
        ###...
        ###...
    """

    kind: ClassVar[str] = "key_lengths"
    lengths: Any
    host: Any = field(default=None, compare=False)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        lengths = self.column(xp)
        return along(xp, xp.arange(k0, k1, device=device), lengths.ndim, -1) < lengths

    def block_states(self, grid):
        return self._states(grid.k_first[None, :], grid.k_last[None, :], self._host_column())

    def key_spans(self, lq, lk):
        if self.host is None:
            return None
        import numpy as np

        stop = np.broadcast_to(np.minimum(self._host_column()[..., 0], lk).astype(np.int64),
                               (*self.host.shape, 1, lq))
        return np.zeros_like(stop), stop

    def allows(self, xp, b, h, q, k, lq, lk):
        return k < per_batch(xp, self.lengths, b)


@dataclass(frozen=True, eq=False, repr=False)
class QueryLengths(_PaddingLengths):
    """Queries ``i >= lengths[b]`` are padding: their rows are fully masked. Made by
    :func:`~portattn.masks.query_lengths`.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> print(masks.text(masks.query_lengths(np.array([2, 4])), 4, 6, batch=0))
        ######
        ######
        ......
        ......
    """

    kind: ClassVar[str] = "query_lengths"
    lengths: Any
    host: Any = field(default=None, compare=False)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        lengths = self.column(xp)
        return along(xp, xp.arange(q0, q1, device=device), lengths.ndim, -2) < lengths

    def block_states(self, grid):
        return self._states(grid.q_first[:, None], grid.q_last[:, None], self._host_column())

    def key_spans(self, lq, lk):
        if self.host is None:
            return None
        import numpy as np

        kept = np.arange(lq) < self._host_column()[..., 0]  # (*batch, 1, Lq)
        return np.zeros(kept.shape, np.int64), np.where(kept, lk, 0).astype(np.int64)

    def allows(self, xp, b, h, q, k, lq, lk):
        return q < per_batch(xp, self.lengths, b)


@dataclass(frozen=True, eq=False, repr=False)
class Prefix(_Lengths, Aligned):
    """The first ``lengths[b]`` positions of batch element ``b`` attend each other:
    query at (bottom-right aligned) position ``0 <= p < lengths[b]`` and key
    ``j < lengths[b]``. A prefix-LM is ``causal() | prefix(lengths)``. Made by
    :func:`~portattn.masks.prefix`.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> print(masks.text(masks.causal() | masks.prefix(np.array([3])), 5, 5))
        ###..
        ###..
        ###..
        ####.
        #####
    """

    kind: ClassVar[str] = "prefix"
    lengths: Any
    shift: int = 0
    origin: int = 0
    host: Any = field(default=None, compare=False)
    cut: bool = False
    """Cut from a larger call by :meth:`Mask.restrict` (its lengths are the whole's)."""

    def _limit(self, lq, lk):
        # Positions are those of the whole call: a part of it cannot check the end.
        return (lk, "prefix lengths", "Lk") if self.whole_call else None

    def structure(self):
        return (self.kind, self.shift, self.origin)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        offset = self.query_offset(lq, lk)
        lengths = self.column(xp)
        rows = along(xp, xp.arange(q0 + offset, q1 + offset, device=device), lengths.ndim, -2)
        cols = along(xp, xp.arange(k0 + self.origin, k1 + self.origin, device=device),
                     lengths.ndim, -1)
        return xp.logical_and(xp.logical_and(rows >= 0, rows < lengths), cols < lengths)

    def allows(self, xp, b, h, q, k, lq, lk):
        position, lengths = q + self.query_offset(lq, lk), per_batch(xp, self.lengths, b)
        return (position >= 0) & (position < lengths) & (k + self.origin < lengths)

    def block_states(self, grid):
        lengths = self._host_column()
        return None if lengths is None else self._states(grid, lengths, None, 2)

    def array_states(self, grid, xp, rank):
        return self._states(grid, self.column(xp), xp, rank)

    def _states(self, grid: Any, lengths: Any, xp: Any, rank: int) -> Any:
        offset = self.query_offset(grid.q_len, grid.kv_len)
        q_first, q_last, k_first, k_last = edges_at_rank(grid, rank)
        q_first, q_last = q_first + offset, q_last + offset
        k_first, k_last = k_first + self.origin, k_last + self.origin
        hidden = (q_last < 0) | (q_first >= lengths) | (k_first >= lengths)
        full = (q_first >= 0) & (q_last < lengths) & (k_last < lengths)
        return tile_states(hidden, full, xp)

    def __repr__(self) -> str:
        return f"prefix(shape={tuple(self.lengths.shape)}{self._position_text()})"
