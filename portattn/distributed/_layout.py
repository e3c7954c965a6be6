"""Where each position of a sequence lives when it is split over ranks.

A :class:`Layout` cuts a sequence of ``length`` positions into chunks of equal size and
gives each rank the same number of chunks, so every rank's shard has the same length
(``shard_length``) and collectives move equal blocks. The last chunks are padded when
``length`` does not divide: no length is refused.

- ``"contiguous"``: rank ``r`` holds chunk ``r`` of ``size`` chunks.
- ``"zigzag"``: the sequence is cut into ``2 * size`` chunks and rank ``r`` holds chunks
  ``r`` and ``2 * size - 1 - r`` (head-tail balancing): under a causal mask every rank
  then sees the same number of (query, key) pairs.
- ``"balanced"`` (:meth:`Layout.balanced`): many chunks, dealt to the ranks from the
  work a mask leaves in each (packed documents, windows, any mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from array_api_compat import array_namespace

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["LAYOUTS", "Layout", "Segment"]

LAYOUTS = ("contiguous", "zigzag")


class Segment(NamedTuple):
    """Global positions ``[start, stop)`` held at local rows ``[offset, offset + stop -
    start)`` of a rank's shard."""

    start: int
    stop: int
    offset: int

    @property
    def local(self) -> slice:
        return slice(self.offset, self.offset + self.stop - self.start)

    def __len__(self) -> int:  # type: ignore[override]
        return self.stop - self.start


@dataclass(frozen=True)
class Layout:
    """How a sequence of ``length`` positions is split over ``size`` ranks.

    Example:
        >>> from portattn.distributed import Layout
        >>> layout = Layout("zigzag", length=10, size=2)
        >>> layout.shard_length, layout.chunk_sizes()
        (6, [3, 3, 2, 2])
        >>> layout.segments(0)
        (Segment(start=0, stop=3, offset=0), Segment(start=8, stop=10, offset=3))
        >>> layout.positions(0), layout.positions(1)
        ([0, 1, 2, 8, 9, -1], [3, 4, 5, 6, 7, -1])
    """

    kind: str
    length: int
    size: int
    assignment: tuple[tuple[int, ...], ...] | None = None
    """``"balanced"`` only: the chunks each rank holds (as many per rank)."""

    def __post_init__(self) -> None:
        if self.kind not in (*LAYOUTS, "balanced"):
            msg = f"layout must be one of {', '.join(map(repr, LAYOUTS))}; got layout={self.kind!r}"
            raise ValueError(msg)
        if (self.kind == "balanced") != (self.assignment is not None):
            msg = ("a balanced layout is made by Layout.balanced(mask, length, size) and "
                   f"only it has an assignment; got kind={self.kind!r}, "
                   f"assignment={self.assignment!r}")
            raise ValueError(msg)
        for name in ("length", "size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (name == "size"):
                msg = (f"{name} must be an int >= {int(name == 'size')}; got "
                       f"{name}={value!r}")
                raise ValueError(msg)

    @classmethod
    def balanced(cls, mask: Any, length: int, size: int, *, chunks_per_rank: int = 8,
                 batch_shape: tuple[int, ...] = (), num_heads: int = 1) -> Layout:
        """A layout that gives every rank the same visible work under ``mask``.

        The sequence is cut into ``size * chunks_per_rank`` chunks; the work of each
        (the pairs its queries attend, counted from the mask's tiles: hidden and full
        ones from the block states, partial ones exactly, on the first batch element
        and head) decides where it goes: the heaviest chunk first, each to the rank
        with the least work among those that still hold fewer than
        ``chunks_per_rank``. Shards stay equal in length. For ``Lq == Lk`` (queries and
        keys share it).

        Args:
            mask: a :mod:`portattn.masks` mask of the whole sequence (its arrays NumPy
                arrays, or none).
            length: positions of the sequence.
            size: ranks.
            chunks_per_rank: more balance for more, smaller pieces of attention.
            batch_shape: the batch shape the mask's arrays are for.
            num_heads: the query heads the mask's arrays are for.

        Example:
            >>> import numpy as np
            >>> from portattn import masks
            >>> from portattn.distributed import Layout
            >>> ids = np.repeat(np.arange(3), [50, 10, 40])
            >>> mask = masks.causal() & masks.documents(ids)
            >>> layout = Layout.balanced(mask, 100, 2, chunks_per_rank=4)
            >>> layout.assignment
            ((1, 3, 4, 6), (0, 2, 5, 7))
        """
        import numpy as np

        base = cls("contiguous", length, size * chunks_per_rank)
        bound = mask.bind(np, batch_shape, num_heads, length, length)
        chunks = [base.segments(c)[0] if base.segments(c) else None
                  for c in range(base.size)]
        work = [0] * base.size
        for c, qs in enumerate(chunks):
            for ks in chunks:
                if qs is None or ks is None:
                    continue
                box = (qs.start, qs.stop, ks.start, ks.stop, length, length)
                if bound.hides(*box):
                    continue
                if bound.covers(*box):
                    work[c] += len(qs) * len(ks)
                    continue
                tile = np.asarray(bound.tile(np, *box[:4], length, length))
                work[c] += int(tile.reshape((-1, *tile.shape[-2:]))[0].sum())
        held: list[list[int]] = [[] for _ in range(size)]
        load = [0] * size
        for c in sorted(range(base.size), key=lambda c: (-work[c], c)):
            r = min((r for r in range(size) if len(held[r]) < chunks_per_rank),
                    key=lambda r: (load[r], r))
            held[r].append(c)
            load[r] += work[c]
        return cls("balanced", length, size, tuple(tuple(sorted(h)) for h in held))

    @property
    def chunks_per_rank(self) -> int:
        if self.assignment is not None:
            return len(self.assignment[0])
        return 2 if self.kind == "zigzag" else 1

    @property
    def chunk(self) -> int:
        """Rows per chunk in a shard; a chunk holds this many positions or one fewer
        (the rest is padding)."""
        return math.ceil(self.length / (self.size * self.chunks_per_rank))

    def chunk_sizes(self) -> list[int]:
        """Positions of each chunk, in sequence order. They differ by at most one; the
        longer ones go first to the ranks' first chunks, then to their second ones,
        so no rank holds two before every rank holds one."""
        n = self.size * self.chunks_per_rank
        base, extra = divmod(self.length, n)
        ranked = [self.chunk_ids(r)[j] for j in range(self.chunks_per_rank)
                  for r in range(self.size)]
        sizes = [base] * n
        for c in ranked[:extra]:
            sizes[c] += 1
        return sizes

    @property
    def shard_length(self) -> int:
        """Rows of every rank's shard, padding included."""
        return self.chunk * self.chunks_per_rank

    def chunk_ids(self, rank: int) -> tuple[int, ...]:
        self._check_rank(rank)
        if self.assignment is not None:
            return self.assignment[rank]
        if self.kind == "zigzag":
            return (rank, 2 * self.size - 1 - rank)
        return (rank,)

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """The non-empty global ranges ``rank`` holds, in local order."""
        sizes = self.chunk_sizes()
        out = []
        for slot, c in enumerate(self.chunk_ids(rank)):
            start = sum(sizes[:c])
            stop = start + sizes[c]
            if stop > start:
                last = out[-1] if out else None
                if last is not None and last.stop == start and \
                        last.offset + len(last) == slot * self.chunk:
                    out[-1] = Segment(last.start, stop, last.offset)  # one piece
                else:
                    out.append(Segment(start, stop, slot * self.chunk))
        return tuple(out)

    def positions(self, rank: int) -> list[int]:
        """The global position of each local row of ``rank``'s shard; -1 for padding."""
        pos = [-1] * self.shard_length
        for seg in self.segments(rank):
            pos[seg.local] = range(seg.start, seg.stop)
        return pos

    def shard(self, x: Any, rank: int, *, axis: int = -2, fill: float = 0) -> Any:
        """``rank``'s shard of the whole array ``x`` (positions along ``axis``), padded
        with ``fill`` to ``shard_length``."""
        xp = array_namespace(x)
        axis = _axis(x, axis)
        if x.shape[axis] != self.length:
            msg = (f"x.shape[{axis}]={x.shape[axis]} does not match the layout's "
                   f"length={self.length}")
            raise ValueError(msg)
        pieces = []
        filled = 0
        for seg in self.segments(rank):
            if seg.offset > filled:
                pieces.append(_zeros(xp, x, axis, seg.offset - filled, fill))
            pieces.append(_take(x, axis, seg.start, seg.stop))
            filled = seg.offset + len(seg)
        if self.shard_length > filled or not pieces:
            pieces.append(_zeros(xp, x, axis, self.shard_length - filled, fill))
        return pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=axis)

    def unshard(self, shards: Sequence[Any], *, axis: int = -2) -> Any:
        """The whole array from every rank's shard (in rank order), padding dropped."""
        shards = list(shards)
        if len(shards) != self.size:
            msg = f"unshard needs one shard per rank ({self.size}); got {len(shards)}"
            raise ValueError(msg)
        xp = array_namespace(*shards)
        axis = _axis(shards[0], axis)
        placed = []
        for rank, s in enumerate(shards):
            if s.shape[axis] != self.shard_length:
                msg = (f"shards[{rank}].shape[{axis}]={s.shape[axis]} does not match the "
                       f"layout's shard_length={self.shard_length}")
                raise ValueError(msg)
            placed += [(seg.start, _take(s, axis, seg.local.start, seg.local.stop))
                       for seg in self.segments(rank)]
        placed.sort(key=lambda p: p[0])
        if not placed:
            return _take(shards[0], axis, 0, 0)
        return xp.concat([p for _, p in placed], axis=axis)

    def rank_major(self, x: Any, *, axis: int = -2, fill: float = 0) -> Any:
        """Every rank's shard of ``x``, one after another along ``axis``: the whole
        array laid out so that an even split of that axis (JAX's ``shard_map``, a
        ``DTensor``'s ``Shard``) gives each rank its shard."""
        xp = array_namespace(x)
        return xp.concat([self.shard(x, r, axis=axis, fill=fill) for r in range(self.size)],
                         axis=_axis(x, axis))

    def from_rank_major(self, x: Any, *, axis: int = -2) -> Any:
        """The inverse of :meth:`rank_major`: sequence order, padding dropped."""
        axis = _axis(x, axis)
        n = self.shard_length
        return self.unshard([_take(x, axis, r * n, (r + 1) * n) for r in range(self.size)],
                            axis=axis)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            msg = f"rank must be an int in [0, {self.size}); got rank={rank!r}"
            raise ValueError(msg)


def _axis(x: Any, axis: int) -> int:
    ndim = len(x.shape)
    if not -ndim <= axis < ndim:
        msg = f"axis={axis} is out of range for an array of {ndim} dimensions"
        raise ValueError(msg)
    return axis % ndim


def _take(x: Any, axis: int, start: int, stop: int) -> Any:
    index = (slice(None),) * axis + (slice(start, stop),)
    return x[index]


def _zeros(xp: Any, x: Any, axis: int, n: int, fill: float = 0) -> Any:
    shape = list(x.shape)
    shape[axis] = n
    return xp.full(tuple(shape), fill, dtype=x.dtype, device=_device(x))


def _device(x: Any) -> Any:
    from array_api_compat import device

    return device(x)
