"""Which (query segment, key segment) pairs a rank computes, and their masks.

A rank's queries and every rank's keys are a few contiguous global ranges
(:class:`~portattn.distributed.Segment`). A pair the mask hides is dropped before any
data moves; a visible pair carries the mask restricted to it (in the pair's own
coordinates, :meth:`portattn.masks.Mask.restrict`), or None when the mask covers it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from ..masks import Mask
    from ._layout import Layout, Segment

__all__ = ["Pair", "Problem", "pieces", "visible_work"]


class Pair(NamedTuple):
    """Queries ``query`` of this rank against keys ``key`` of rank ``source``."""

    source: int
    query: Segment
    key: Segment
    mask: Mask | None
    """The mask of the pair in its own coordinates; None: every pair attends."""


@dataclass(frozen=True, eq=False)
class Problem:
    """One distributed attention call as rank ``rank`` sees it.

    ``mask`` is bound to the whole call (global ``queries.length`` x ``keys.length``)
    and decides which pairs are visible; ``given`` is the mask as the caller gave it,
    which each visible pair restricts (a pair's call binds it again, to its own shapes).
    """

    xp: Any
    rank: int
    queries: Layout
    keys: Layout
    mask: Mask | None = None
    scale: float | None = None
    softcap: float | None = None
    given: Mask | None = None
    _pairs: dict[tuple[Any, ...], tuple[Pair, ...]] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return self.queries.size

    @property
    def options(self) -> dict[str, Any]:
        return {"scale": self.scale, "softcap": self.softcap}

    def for_rank(self, rank: int) -> Problem:
        """The same call as rank ``rank`` sees it (for engines whose rank is only known
        on the device: one branch per rank)."""
        return replace(self, rank=rank, _pairs=self._pairs)

    @property
    def unbound(self) -> Mask | None:
        return self.mask if self.given is None else self.given

    def pairs(self, source: int, rank: int | None = None,
              rows: tuple[int, int] | None = None) -> tuple[Pair, ...]:
        """The visible pairs of ``rank``'s queries (default: this rank) against the
        keys of ``source``; with ``rows = (a, b)``, against the keys at rows ``[a, b)``
        of its shard only, their segments' offsets counted from ``a`` (a piece of the
        shard that travels alone)."""
        rank = self.rank if rank is None else rank
        found = self._pairs.get((rank, source, rows))
        if found is None:
            found = tuple(self._visible(rank, source, rows))
            self._pairs[(rank, source, rows)] = found
        return found

    def _visible(self, rank: int, source: int, rows: tuple[int, int] | None) -> Any:
        lq, lk = self.queries.length, self.keys.length
        for qs in self.queries.segments(rank):
            for ks in _within(self.keys.segments(source), rows):
                box = (qs.start, qs.stop, ks.start, ks.stop, lq, lk)
                if self.mask is None:
                    yield Pair(source, qs, ks, None)
                elif self.mask.hides(*box):
                    continue
                elif self.mask.covers(*box):
                    yield Pair(source, qs, ks, None)
                else:
                    yield Pair(source, qs, ks,
                               self.unbound.restrict(self.xp, qs.start, qs.stop, ks.start,
                                                  ks.stop, lq, lk))


def _within(segments: tuple[Segment, ...], rows: tuple[int, int] | None) -> Any:
    """The parts of ``segments`` at local rows ``[a, b)``, offsets counted from ``a``."""
    if rows is None:
        yield from segments
        return
    a, b = rows
    for seg in segments:
        lo, hi = max(seg.offset, a), min(seg.offset + len(seg), b)
        if lo < hi:
            yield type(seg)(seg.start + lo - seg.offset, seg.start + hi - seg.offset, lo - a)


def pieces(length: int, count: int) -> list[tuple[int, int]]:
    """``[a, b)`` row ranges cutting a shard of ``length`` rows into ``count`` pieces
    (fewer for a shorter shard), as equal as can be."""
    count = max(1, min(count, length))
    return [(length * i // count, length * (i + 1) // count) for i in range(count)]


def visible_work(problem: Problem) -> list[int]:
    """The (query, key) pairs each rank attends, summed over its visible segment
    pairs, counted from each pair's mask tile (one batch element and head where the
    mask varies: for comparing ranks, not for absolute counts)."""
    xp = problem.xp
    work = []
    for rank in range(problem.size):
        total = 0
        for source in range(problem.size):
            for pair in problem.pairs(source, rank):
                n, m = len(pair.query), len(pair.key)
                if pair.mask is None:
                    total += n * m
                    continue
                tile = pair.mask.tile(xp, 0, n, 0, m, n, m)
                while len(tile.shape) > 2:
                    tile = tile[0]
                total += int(xp.sum(xp.astype(tile, xp.int64)))
        work.append(total)
    return work
