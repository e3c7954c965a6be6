"""Document masks for packed sequences: several documents share one row of the batch.

Query ``i`` and key ``j`` of batch element ``b`` attend only when they carry the same
segment id (``query_ids[b, i] == key_ids[b, j]``); a negative id marks padding, which
attends nothing. Combined with ``causal()`` through ``&`` it is the usual mask for
training on packed batches.

Skipping the tiles across documents needs the ids' values: when the mask is bound to a
call whose ids can be read, their host copies give each batch element's tiles (a tile
whose key ids all lie outside the range of its query ids is hidden, a tile of one
document needs no mask), and a ``DocumentPlan`` keeps, per position, the smallest
and largest id over the batch for the single-tile questions. Traced or lazy ids get
neither: every tile is visited, which stays correct.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from .._lib import dtype_name, host_copy
from ._base import Mask, blocked, interval_states, per_position, replaced, tile_states
from ._values import array_argument, signed

__all__ = ["DocumentPlan", "Documents", "ids_from_cu_seqlens"]


@dataclass(frozen=True, eq=False)
class DocumentPlan:
    """Per position, over the batch: smallest and largest non-negative id and whether
    some batch element has padding (a negative id) there. NumPy arrays on the host."""

    q_lo: Any
    q_hi: Any
    q_pad: Any
    k_lo: Any
    k_hi: Any
    k_pad: Any

    @classmethod
    def of(cls, query_ids: Any, key_ids: Any) -> DocumentPlan:
        """The plan of host copies of the ids."""
        return cls(*_extremes(query_ids), *_extremes(key_ids))

    def _query_span(self, q0: int, q1: int) -> tuple[int, int]:
        return int(self.q_lo[q0:q1].min()), int(self.q_hi[q0:q1].max())

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        lo, hi = self._query_span(q0, q1)
        reachable = (self.k_hi >= lo) & (self.k_lo <= hi)
        found = reachable.nonzero()[0]
        return (0, 0) if lo > hi or not found.size else (int(found[0]), int(found[-1]) + 1)

    def hides(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        lo, hi = self._query_span(q0, q1)
        return lo > hi or int(self.k_hi[k0:k1].max()) < lo or int(self.k_lo[k0:k1].min()) > hi

    def covers(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        # in constant time: planners ask it of thousands of tiles per new mask
        q_runs, k_runs = self._q_runs, self._k_runs
        return (q0 < q1 and k0 < k1 and q_runs[q0] >= 0 and q_runs[q1 - 1] == q_runs[q0]
                and k_runs[k0] >= 0 and k_runs[k1 - 1] == k_runs[k0]
                and self.q_lo[q0] == self.k_lo[k0])

    @cached_property
    def _q_runs(self) -> Any:
        return _runs(self.q_lo, self.q_hi, self.q_pad)

    @cached_property
    def _k_runs(self) -> Any:
        return _runs(self.k_lo, self.k_hi, self.k_pad)

    def sliced(self, q0: int, q1: int, k0: int, k1: int) -> DocumentPlan:
        qs, ks = slice(q0, q1), slice(k0, k1)
        return DocumentPlan(self.q_lo[qs], self.q_hi[qs], self.q_pad[qs],
                            self.k_lo[ks], self.k_hi[ks], self.k_pad[ks])


def _runs(lo: Any, hi: Any, pad: Any) -> Any:
    """Per position, the number of the run of neighbours that hold one id in every
    batch element (and no padding) it lies in; -1 where it holds more than one id or
    padding."""
    import numpy as np

    single = (lo == hi) & ~pad
    starts = single.copy()
    starts[1:] &= ~single[:-1] | (lo[1:] != lo[:-1])
    return np.where(single, np.cumsum(starts) - 1, -1)


def _document_spans(query_ids: Any, key_ids: Any) -> tuple[Any, Any] | None:
    """Each query's run of keys of its own document, ``(start, stop)``, where every
    document's keys lie together in ``key_ids`` (1-d); None where one's lie apart."""
    import numpy as np

    cuts = np.flatnonzero(np.diff(key_ids)) + 1
    starts = np.concatenate([[0], cuts]).astype(np.int64)
    stops = np.concatenate([cuts, [len(key_ids)]]).astype(np.int64)
    ids = key_ids[starts] if len(key_ids) else key_ids[:0]
    kept = ids >= 0
    ids, starts, stops = ids[kept], starts[kept], stops[kept]
    order = np.argsort(ids, kind="stable")
    ids, starts, stops = ids[order], starts[order], stops[order]
    if (ids[1:] == ids[:-1]).any():  # a document's keys in two runs or more
        return None
    empty = np.zeros(len(query_ids), np.int64)
    if not len(ids):
        return empty, empty
    at = np.minimum(np.searchsorted(ids, query_ids), len(ids) - 1)
    found = (ids[at] == query_ids) & (query_ids >= 0)
    return np.where(found, starts[at], empty), np.where(found, stops[at], empty)


def _block_ids(reduce: Any, ids: Any) -> tuple[Any, Any, Any]:
    """Per block: the smallest and largest non-negative id (``lo > hi`` when the block
    is all padding) and whether the block has no padding."""
    import numpy as np

    pad = ids < 0
    lo = reduce(np.minimum, np.where(pad, np.iinfo(np.int64).max, ids))
    hi = reduce(np.maximum, np.where(pad, -1, ids))
    return lo, hi, ~reduce(np.logical_or, pad)


def _extremes(ids: Any) -> tuple[Any, Any, Any]:
    import numpy as np

    rows = int(np.prod(ids.shape[:-1]))  # not -1: ambiguous for zero-size arrays
    flat = ids.reshape(rows, ids.shape[-1]).astype(np.int64)
    pad = flat < 0
    big = np.iinfo(np.int64).max
    # padding leaves the range: a position that is padding everywhere gets lo > hi
    lo = np.where(pad, big, flat).min(axis=0, initial=big)
    hi = np.where(pad, -1, flat).max(axis=0, initial=-1)
    return lo, hi, pad.any(axis=0)


@dataclass(frozen=True, eq=False, repr=False)
class Documents(Mask):
    """Pairs whose segment ids are equal and non-negative; made by
    :func:`~portattn.masks.documents` or
    :func:`~portattn.masks.documents_from_cu_seqlens`.

    ``query_ids`` is ``(*batch, Lq)`` or ``(Lq,)`` (shared by the batch), ``key_ids``
    likewise with ``Lk``; a negative id is padding. Once bound to a call whose ids can
    be read, ``host`` holds their copies and ``plan`` their extremes per position,
    from which the block form skips the tiles across documents.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.documents(np.array([0, 0, 0, 1, 1, -1]))
        >>> print(masks.text(mask & masks.causal(), 6, 6))
        #.....
        ##....
        ###...
        ...#..
        ...##.
        ......
        >>> bound = mask.bind(np, (1,), 1, 6, 6)  # batch (1,), 1 head, Lq=Lk=6
        >>> masks.block_mask(bound, 6, 6, 3, 3).states[0, 0].tolist()
        [[2, 0], [0, 1]]
    """

    kind: ClassVar[str] = "documents"
    own_axes: ClassVar[int | None] = 1
    query_ids: Any
    key_ids: Any
    plan: DocumentPlan | None = field(default=None, compare=False)
    host: tuple[Any, Any] | None = field(default=None, compare=False)
    """``(query_ids, key_ids)`` on the host, when they could be read."""

    def __post_init__(self) -> None:
        for name in ("query_ids", "key_ids"):
            object.__setattr__(self, name, array_argument(
                getattr(self, name), "documents", "integer arrays of segment ids", name))

    @property
    def arrays(self):
        return (self.query_ids, self.key_ids)

    def with_arrays(self, arrays):
        query_ids, key_ids = arrays
        return replaced(self, query_ids=query_ids, key_ids=key_ids, plan=None, host=None)

    def for_call(self, xp, batch_shape, num_heads, lq, lk, device=None):
        ids = []
        for name, a, length, length_name in (("query_ids", self.query_ids, lq, "Lq"),
                                             ("key_ids", self.key_ids, lk, "Lk")):
            if not xp.isdtype(a.dtype, "integral"):
                msg = (f"documents {name} must have an integer dtype; got "
                       f"{name}.dtype={dtype_name(a.dtype)}")
                raise TypeError(msg)
            shape = tuple(a.shape)
            if shape not in ((length,), (*batch_shape, length)):
                msg = (f"documents {name} must have shape ({length_name},) = ({length},) or "
                       f"(*batch, {length_name}) = {(*batch_shape, length)}; got "
                       f"{name}.shape={shape}")
                raise ValueError(msg)
            ids.append(xp.reshape(signed(xp, a), (1,) * (len(batch_shape) + 1 - len(shape))
                                  + shape))
        query_ids, key_ids = ids
        host = host_copy(query_ids), host_copy(key_ids)
        if any(h is None for h in host):
            return replaced(self, query_ids=query_ids, key_ids=key_ids, plan=None, host=None)
        return replaced(self, query_ids=query_ids, key_ids=key_ids,
                        plan=DocumentPlan.of(*host), host=host)

    def ids_on_host(self) -> tuple[Any, Any] | None:
        """``(query_ids, key_ids)`` as NumPy arrays ``(*batch | 1, L)``, read when the
        mask was bound to its call; None when they could not be read (traced, lazy) or
        it is not bound."""
        return self.host

    def key_spans(self, lq, lk):
        # a run per row where each document's keys lie together (packed sequences)
        if self.host is None:
            return None
        import numpy as np

        q, k = self.host
        lead = np.broadcast_shapes(q.shape[:-1], k.shape[:-1])
        q = np.broadcast_to(q, (*lead, lq)).reshape(-1, lq)
        k = np.broadcast_to(k, (*lead, lk)).reshape(-1, lk)
        spans = [_document_spans(a, b) for a, b in zip(q, k, strict=True)]
        if any(found is None for found in spans):
            return None
        start, stop = (np.stack([found[i] for found in spans]).reshape(*lead, 1, lq)
                       for i in (0, 1))  # the head axis: one document layout for all
        return start, stop

    def block_states(self, grid):
        if self.host is None:
            return None
        import numpy as np

        q, k = (a.astype(np.int64) for a in self.host)  # (*batch, L): a plan per element
        q_lo, q_hi, q_exact = _block_ids(grid.reduce_q, q)
        k_lo, k_hi, k_exact = _block_ids(grid.reduce_k, k)
        states = interval_states(q_lo, q_hi, k_lo, k_hi, q_exact, k_exact)
        return states.reshape(*states.shape[:-2], 1, *states.shape[-2:])  # one for all heads

    def array_states(self, grid, xp, rank):
        # each block's smallest and largest id, where the ids are (traced)
        q_lo, q_hi, q_exact = (x[..., None, :, None] for x in _id_extremes(
            xp, self.query_ids, grid.q_edges))
        k_lo, k_hi, k_exact = (x[..., None, None, :] for x in _id_extremes(
            xp, self.key_ids, grid.k_edges))
        hidden = (q_lo > q_hi) | (k_lo > k_hi) | (q_hi < k_lo) | (k_hi < q_lo)
        full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo) & q_exact & k_exact
        return tile_states(hidden, full, xp)  # (*batch | 1, 1, nq, nk)

    def key_range(self, q0, q1, lq, lk):
        return (0, lk) if self.plan is None else self.plan.key_range(q0, q1)

    def hides(self, q0, q1, k0, k1, lq, lk):
        return q0 >= q1 or k0 >= k1 or (self.plan is not None
                                         and self.plan.hides(q0, q1, k0, k1))

    def covers(self, q0, q1, k0, k1, lq, lk):
        return self.plan is not None and self.plan.covers(q0, q1, k0, k1)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        q = self.query_ids[..., q0:q1]
        k = self.key_ids[..., k0:k1]
        q = xp.reshape(q, (*q.shape[:-1], 1, q1 - q0, 1))
        k = xp.reshape(k, (*k.shape[:-1], 1, 1, k1 - k0))
        return xp.logical_and(q == k, q >= 0)

    def allows(self, xp, b, h, q, k, lq, lk):
        q_ids = per_position(xp, self.query_ids, b, q)
        return (q_ids == per_position(xp, self.key_ids, b, k)) & (q_ids >= 0)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        plan = None if self.plan is None else self.plan.sliced(q0, q1, k0, k1)
        host = None if self.host is None else (self.host[0][..., q0:q1], self.host[1][..., k0:k1])
        return replaced(self, query_ids=self.query_ids[..., q0:q1],
                        key_ids=self.key_ids[..., k0:k1], plan=plan, host=host)

    def __repr__(self) -> str:
        return (f"documents(query_ids.shape={tuple(self.query_ids.shape)}, "
                f"key_ids.shape={tuple(self.key_ids.shape)})")


def ids_from_cu_seqlens(cu_seqlens: Any, length: int) -> Any:
    """Segment ids ``(*batch, length)`` from cumulative lengths ``(*batch, n + 1)``:
    document ``d`` holds positions ``cu[d] <= j < cu[d + 1]``; positions outside
    ``[cu[0], cu[n])`` get id -1 (padding)."""
    from array_api_compat import array_namespace, device

    xp = array_namespace(cu_seqlens)
    if not xp.isdtype(cu_seqlens.dtype, "integral") or cu_seqlens.ndim < 1 \
            or cu_seqlens.shape[-1] < 1:
        msg = ("cu_seqlens must be an integer array (*batch, n + 1) of cumulative "
               f"lengths; got cu_seqlens.shape={tuple(cu_seqlens.shape)}, "
               f"dtype={dtype_name(cu_seqlens.dtype)}")
        raise ValueError(msg)
    cu = signed(xp, cu_seqlens)
    positions = xp.arange(length, device=device(cu))
    ends = cu[..., 1:, None]
    ids = xp.sum(xp.astype(ends <= positions, cu.dtype), axis=-2)
    inside = xp.logical_and(positions >= cu[..., :1], positions < cu[..., -1:])
    return xp.where(inside, ids, xp.full_like(ids, -1))


def _id_extremes(xp: Any, ids: Any, edges: Any) -> tuple[Any, Any, Any]:
    """Per block: the smallest and largest non-negative id (``lo > hi``: all padding),
    and whether no position is padding."""
    blocks = blocked(xp, ids, edges)
    pad = blocks < 0
    lo = xp.min(xp.where(pad, xp.iinfo(ids.dtype).max, blocks), axis=-1)
    hi = xp.max(xp.where(pad, -1, blocks), axis=-1)
    return lo, hi, xp.logical_not(xp.any(pad, axis=-1))
