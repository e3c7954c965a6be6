"""The sparse patterns of long-context models, each defined by absolute positions
(bottom-right aligned, like the rest: query ``i`` at ``i + Lk - Lq``):

- :class:`SinkTokens`: the first ``n`` keys, visible to every query (StreamingLLM's
  attention sinks, ``causal() & (sliding_window(w) | sink_tokens(4))``);
- :class:`GlobalTokens`: tokens that see every key and that every query sees
  (Longformer, BigBird);
- :class:`Chunks`: query and key in the same chunk of ``size`` positions (Llama 4's
  chunked attention);
- :class:`BlockLayout`: one boolean per pair of position blocks (BigBird's random
  blocks, the Sparse Transformer's strides).

A query at a negative position (only when ``Lq > Lk``) belongs to no chunk, no
layout row and is no global token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from array_api_compat import device as device_of

from .._lib import dtype_name, host_copy
from ._base import (
    Aligned,
    along,
    blocked,
    expand_to_rank,
    interval_states,
    linear_index,
    replaced,
    tile_states,
)
from ._values import array_argument, signed

__all__ = ["BlockLayout", "Chunks", "GlobalTokens", "SinkTokens"]


def _check_count(kind: str, name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        msg = f"{kind} {name} must be an int >= {low}; got {name}={value!r}"
        raise ValueError(msg)


def _positions(xp: Any, first: int, last: int, device: Any) -> Any:
    return xp.arange(first, last, device=device)


@dataclass(frozen=True, eq=False, repr=False)
class SinkTokens(Aligned):
    """Keys at positions ``j < count`` are visible to every query; made by
    :func:`~portattn.masks.sink_tokens`.

    Alone it hides every other key: it is meant for a union, such as StreamingLLM's
    ``sliding_window(w) | sink_tokens(n)``.

    Example:
        >>> from portattn import masks
        >>> mask = masks.sliding_window(1) | masks.sink_tokens(2)
        >>> print(masks.text(mask, 5, 5))
        ##...
        ##...
        ###..
        ####.
        ##.##
        >>> masks.sink_tokens(2).key_range(0, 5, 5, 5)
        (0, 2)
    """

    kind: ClassVar[str] = "sink_tokens"
    count: int
    shift: int = 0
    origin: int = 0

    def __post_init__(self) -> None:
        _check_count("sink_tokens", "count", self.count, 0)

    def structure(self):
        return (self.kind, self.count, self.shift, self.origin)

    def key(self):
        return self.structure()

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        cols = _positions(xp, k0 + self.origin, k1 + self.origin, device)[None, :]
        return xp.broadcast_to(cols < self.count, (q1 - q0, k1 - k0))

    def allows(self, xp, b, h, q, k, lq, lk):
        return k + self.origin < self.count

    def block_states(self, grid):
        first, last = grid.k_first + self.origin, grid.k_last + self.origin
        return tile_states(first >= self.count, last < self.count)[None, :]

    def key_range(self, q0, q1, lq, lk):
        return 0, min(lk, max(0, self.count - self.origin))

    def __repr__(self) -> str:
        return f"sink_tokens({self.count}{self._position_text()})"


@dataclass(frozen=True, eq=False, repr=False)
class Chunks(Aligned):
    """Query at position ``p`` attends key ``j`` when ``p // size == j // size``; made
    by :func:`~portattn.masks.chunks`.

    Example:
        >>> from portattn import masks
        >>> mask = masks.chunks(3)
        >>> mask.key_range(3, 5, 6, 6)  # queries 3 and 4 see the second chunk
        (3, 6)
        >>> print(masks.text(mask & masks.causal(), 6, 6))
        #.....
        ##....
        ###...
        ...#..
        ...##.
        ...###
    """

    kind: ClassVar[str] = "chunks"
    size: int
    shift: int = 0
    origin: int = 0

    def __post_init__(self) -> None:
        _check_count("chunks", "size", self.size, 1)

    def structure(self):
        return (self.kind, self.size, self.shift, self.origin)

    def key(self):
        return self.structure()

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        offset = self.query_offset(lq, lk)
        rows = _positions(xp, q0 + offset, q1 + offset, device)[:, None]
        cols = _positions(xp, k0 + self.origin, k1 + self.origin, device)[None, :]
        return (rows // self.size) == (cols // self.size)

    def allows(self, xp, b, h, q, k, lq, lk):
        return (q + self.query_offset(lq, lk)) // self.size == (k + self.origin) // self.size

    def block_states(self, grid):
        offset = self.query_offset(grid.q_len, grid.kv_len)
        q_lo, q_hi = (grid.q_first + offset) // self.size, (grid.q_last + offset) // self.size
        k_lo = (grid.k_first + self.origin) // self.size
        k_hi = (grid.k_last + self.origin) // self.size
        return interval_states(q_lo, q_hi, k_lo, k_hi)

    def key_range(self, q0, q1, lq, lk):
        offset = self.query_offset(lq, lk)
        first, last = (q0 + offset) // self.size, (q1 - 1 + offset) // self.size
        lo = max(0, first * self.size - self.origin)
        hi = min(lk, (last + 1) * self.size - self.origin)
        return (lo, hi) if lo < hi and q0 < q1 else (0, 0)

    def __repr__(self) -> str:
        return f"chunks({self.size}{self._position_text()})"


@dataclass(frozen=True, eq=False, repr=False)
class GlobalTokens(Aligned):
    """The tokens at ``positions`` attend every key, and every query attends them.
    ``positions`` is ``(n,)`` or ``(*batch, n)`` integers; negative entries are unused
    (so batch elements may have different numbers of global tokens). Made by
    :func:`~portattn.masks.global_tokens`, usually joined to a local pattern with ``|``.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.global_tokens(np.array([0])) | masks.sliding_window(0)
        >>> print(masks.text(mask, 5, 5))
        #####
        ##...
        #.#..
        #..#.
        #...#
    """

    kind: ClassVar[str] = "global_tokens"
    own_axes: ClassVar[int | None] = 1
    positions: Any
    shift: int = 0
    origin: int = 0
    host: Any = field(default=None, compare=False)
    cut: bool = False
    """Cut from a larger call by :meth:`Mask.restrict` (its positions are the whole's)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "positions", array_argument(
            self.positions, "global_tokens", "an integer array of positions"))

    @property
    def arrays(self):
        return (self.positions,)

    def with_arrays(self, arrays):
        (positions,) = arrays
        return replaced(self, positions=positions, host=None)

    def structure(self):
        return (self.kind, self.shift, self.origin)

    def for_call(self, xp, batch_shape, num_heads, lq, lk, device=None):
        positions = self.positions
        if not xp.isdtype(positions.dtype, "integral"):
            msg = ("global_tokens positions must have an integer dtype; got "
                   f"positions.dtype={dtype_name(positions.dtype)}")
            raise TypeError(msg)
        shape = tuple(positions.shape)
        if len(shape) != 1 and shape[:-1] != tuple(batch_shape):
            msg = (f"global_tokens positions must have shape (n,) or (*batch, n) with "
                   f"batch={tuple(batch_shape)}; got positions.shape={shape}")
            raise ValueError(msg)
        positions = signed(xp, positions)
        host = host_copy(positions)
        # Positions are those of the whole call: a part of it cannot check the end.
        if host is not None and host.size and self.whole_call and host.max() >= lk:
            msg = (f"global_tokens positions must lie below Lk={lk} (negative ones are "
                   f"unused); got positions with max={int(host.max())}")
            raise ValueError(msg)
        return replaced(self, positions=positions, host=host)

    def positions_on_host(self) -> Any:
        """The positions as a NumPy array, read when the mask was bound to its call;
        None when they could not be read (traced, lazy) or it is not bound."""
        return self.host

    def _flags(self, xp: Any, positions: Any, first: int, last: int, device: Any) -> Any:
        """``(*lead, last - first)``: whether each position is a global token."""
        index = _positions(xp, first, last, device)
        chosen = positions[..., None, :]
        # a negative entry is unused, never the position of a query before the keys
        return xp.any((index[:, None] == chosen) & (chosen >= 0), axis=-1)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        offset = self.query_offset(lq, lk)
        rows = self._flags(xp, self.positions, q0 + offset, q1 + offset, device)
        cols = self._flags(xp, self.positions, k0 + self.origin, k1 + self.origin, device)
        if rows.ndim == 1:
            return xp.logical_or(rows[:, None], cols[None, :])
        lead = tuple(rows.shape[:-1])
        return xp.logical_or(xp.reshape(rows, (*lead, 1, q1 - q0, 1)),
                             xp.reshape(cols, (*lead, 1, 1, k1 - k0)))

    def allows(self, xp, b, h, q, k, lq, lk):
        positions = self.positions
        if positions.ndim > 1:  # one row per batch element
            n = positions.shape[-1]
            columns = xp.arange(n, device=device_of(positions))
            positions = xp.reshape(positions, (-1,))[b[..., None] * n + columns]
        used = positions >= 0
        return (xp.any(((q + self.query_offset(lq, lk))[..., None] == positions) & used, axis=-1)
                | xp.any(((k + self.origin)[..., None] == positions) & used, axis=-1))

    def block_states(self, grid):
        if self.host is None:
            return None
        import numpy as np

        offset = self.query_offset(grid.q_len, grid.kv_len)
        found = []
        for edges, moved, reduce in ((grid.q_edges, offset, grid.reduce_q),
                                     (grid.k_edges, self.origin, grid.reduce_k)):
            flags = self._flags(np, self.host, int(edges[0]) + moved, int(edges[-1]) + moved,
                                None)
            full_flags = np.zeros((*flags.shape[:-1], int(edges[-1])), dtype=bool)
            full_flags[..., int(edges[0]):] = flags
            found.append((reduce(np.logical_or, full_flags), reduce(np.logical_and, full_flags)))
        (q_any, q_all), (k_any, k_all) = found
        states = tile_states(~q_any[..., :, None] & ~k_any[..., None, :],
                             q_all[..., :, None] | k_all[..., None, :])
        return states if states.ndim == 2 else states[..., None, :, :]

    def array_states(self, grid, xp, rank):
        # per position, whether it is a global token, where the positions are (traced)
        positions = self.positions  # (n,) or (*batch, n); negative entries are unused
        lead = positions.shape[:-1]
        chosen = positions[..., None, :]
        found = []
        for edges, first in ((grid.q_edges, self.query_offset(grid.q_len, grid.kv_len)),
                             (grid.k_edges, self.origin)):
            length = int(edges[-1])
            index = xp.reshape(xp.arange(first, first + length, dtype=positions.dtype),
                               (1,) * len(lead) + (length, 1))  # one rank: no promotion
            flags = xp.any((index == chosen) & (chosen >= 0), axis=-1)  # (*lead, length)
            per_block = blocked(xp, flags, edges)
            found.append((xp.any(per_block, axis=-1), xp.all(per_block, axis=-1)))
        (q_any, q_all), (k_any, k_all) = found
        states = tile_states(xp.logical_not(q_any[..., :, None])
                             & xp.logical_not(k_any[..., None, :]),
                             q_all[..., :, None] | k_all[..., None, :], xp)
        return states[..., None, :, :] if positions.ndim > 1 else states

    def __repr__(self) -> str:
        return f"global_tokens(shape={tuple(self.positions.shape)}{self._position_text()})"


@dataclass(frozen=True, eq=False, repr=False)
class BlockLayout(Aligned):
    """Query at position ``p >= 0`` attends key ``j`` when
    ``layout[..., p // block_q, j // block_k]``. ``layout`` is boolean, ``(R, C)`` or
    broadcastable to ``(*batch, H, R, C)``, with ``R = ceil(Lk / block_q)`` and
    ``C = ceil(Lk / block_k)`` (rows and columns for positions ``0 .. Lk - 1``).
    Made by :func:`~portattn.masks.block_layout`.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> layout = np.array([[True, False], [True, True]])
        >>> mask = masks.block_layout(layout, 3)
        >>> mask.block_q, mask.block_k
        (3, 3)
        >>> print(masks.text(mask, 6, 6))
        ###...
        ###...
        ###...
        ######
        ######
        ######
    """

    kind: ClassVar[str] = "block_layout"
    own_axes: ClassVar[int | None] = 2
    layout: Any
    block_q: int
    block_k: int
    shift: int = 0
    origin: int = 0
    batch_shape: tuple[int, ...] | None = field(default=None, compare=False)
    cut: bool = False
    """Cut from a larger call by :meth:`Mask.restrict` (its layout is the whole's)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", array_argument(self.layout, "block_layout",
                                                          "a boolean array"))
        _check_count("block_layout", "block_q", self.block_q, 1)
        _check_count("block_layout", "block_k", self.block_k, 1)

    @property
    def arrays(self):
        return (self.layout,)

    def with_arrays(self, arrays):
        (layout,) = arrays
        return replaced(self, layout=layout)

    def structure(self):
        return (self.kind, self.block_q, self.block_k, self.shift, self.origin, self.cut)

    def for_call(self, xp, batch_shape, num_heads, lq, lk, device=None):
        if not xp.isdtype(self.layout.dtype, "bool"):
            msg = ("block_layout layout must have dtype bool (True = attend); got "
                   f"layout.dtype={dtype_name(self.layout.dtype)}")
            raise TypeError(msg)
        rows, cols = math.ceil(lk / self.block_q), math.ceil(lk / self.block_k)
        shape = tuple(self.layout.shape)
        # A part of a larger call (restrict) keeps the layout of the whole.
        covering = len(shape) >= 2 and shape[-2] * self.block_q >= lk + self.origin \
            and shape[-1] * self.block_k >= lk + self.origin
        if len(shape) < 2 or (shape[-2:] != (rows, cols) and not (self.cut and covering)):
            msg = (f"block_layout layout must end in (ceil(Lk / block_q), ceil(Lk / block_k))"
                   f" = ({rows}, {cols}) for Lk={lk}, block_q={self.block_q}, "
                   f"block_k={self.block_k}; got layout.shape={shape}")
            raise ValueError(msg)
        layout = expand_to_rank(xp, self.layout, (*batch_shape, num_heads, *shape[-2:]),
                                "block_layout layout")
        return replaced(self, layout=layout, batch_shape=tuple(batch_shape))

    def allows(self, xp, b, h, q, k, lq, lk):
        position = q + self.query_offset(lq, lk)
        row = xp.where(position < 0, 0, position) // self.block_q
        index = linear_index(tuple(self.layout.shape), self.batch_shape or (), b, h, row,
                             (k + self.origin) // self.block_k)
        return xp.reshape(self.layout, (-1,))[index] & (position >= 0)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        offset = self.query_offset(lq, lk)
        rows = _positions(xp, q0 + offset, q1 + offset, device)
        cols = _positions(xp, k0 + self.origin, k1 + self.origin, device)
        cells = xp.take(self.layout, xp.where(rows < 0, 0, rows) // self.block_q, axis=-2)
        cells = xp.take(cells, cols // self.block_k, axis=-1)
        return xp.logical_and(cells, along(xp, rows >= 0, len(cells.shape), -2))

    def block_states(self, grid):
        layout = host_copy(self.layout)
        if layout is None:
            return None
        import numpy as np

        # Trues in any rectangle of cells from one table of running sums.
        sums = np.zeros((*layout.shape[:-2], layout.shape[-2] + 1, layout.shape[-1] + 1),
                        dtype=np.int64)
        sums[..., 1:, 1:] = layout.cumsum(-2).cumsum(-1)
        offset = self.query_offset(grid.q_len, grid.kv_len)
        q_first, q_last = grid.q_first + offset, grid.q_last + offset
        r0 = np.maximum(q_first, 0)[:, None] // self.block_q
        r1 = np.maximum(q_last, 0)[:, None] // self.block_q + 1
        c0 = (grid.k_first + self.origin)[None, :] // self.block_k
        c1 = (grid.k_last + self.origin)[None, :] // self.block_k + 1
        count = sums[..., r1, c1] - sums[..., r0, c1] - sums[..., r1, c0] + sums[..., r0, c0]
        before = (q_last < 0)[:, None]
        return tile_states((count == 0) | before,
                           (count == (r1 - r0) * (c1 - c0)) & (q_first >= 0)[:, None])

    def __repr__(self) -> str:
        return (f"block_layout(shape={tuple(self.layout.shape)}, block_q={self.block_q}, "
                f"block_k={self.block_k}{self._position_text()})")
