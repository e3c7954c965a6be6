"""A packed-documents mask as independent segments, read from its ids on the host.

``documents(ids)``, alone or ``&`` ``causal()``, ``key_lengths`` and
``query_lengths``, is block diagonal when each document's keys are contiguous: the
queries of a run of equal ids see only that document's keys, so the call splits into
one attention per run, full or causal, and rows that see no key (padding, a document
without keys, rows past ``query_lengths``) stay 0 with log-sum-exp ``-inf``. This is
how flash-attn's varlen functions work; here the runs come from the mask's host copy
of the ids (:attr:`portattn.masks.Documents.host`), so only calls whose values can be
read have a plan. Without a documents mask each batch element is one segment (its
``key_lengths`` and ``query_lengths`` cut it short).

:func:`plan_of` returns ``None`` when the ids are not block diagonal (a document whose
keys are split in two runs): such a call runs on another path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

#: The mask kinds a segment plan reads.
KINDS = frozenset({"documents", "causal", "key_lengths", "query_lengths"})

#: Below this many keys torch's CPU flash kernel without a mask tensor gives 0
#: instead of NaN for the row of a NaN query (as ``_translate.CPU_MASKLESS_MIN_KEYS``
#: says for SDPA): shorter segments are given a mask tensor.
MASKLESS_MIN_KEYS = 16


@dataclass(frozen=True)
class Segment:
    """Rows ``[q0, q1)`` attend keys ``[k0, k1)``; with ``shift`` not None, row
    ``q0 + r`` attends only keys ``k0 + c`` with ``c <= r + shift`` (``shift == 0``:
    top-left causal). ``q1 > q0`` and ``k1 > k0``; row ``q0`` sees key ``k0``."""

    q0: int
    q1: int
    k0: int
    k1: int
    shift: int | None

    @property
    def is_causal(self) -> bool:
        """torch's ``is_causal`` says it all (no mask tensor)."""
        return self.shift == 0 and self.k1 - self.k0 >= MASKLESS_MIN_KEYS

    @property
    def needs_mask(self) -> bool:
        """A float mask tensor is needed: causal with an offset, or few keys."""
        return not self.is_causal and (self.shift is not None
                                       or self.k1 - self.k0 < MASKLESS_MIN_KEYS)

    @property
    def pairs(self) -> int:
        """Pairs visible in the segment."""
        nq, nk = self.q1 - self.q0, self.k1 - self.k0
        if self.shift is None:
            return nq * nk
        return sum(min(nk, r + self.shift + 1) for r in range(nq))


@dataclass(frozen=True)
class Plan:
    """Segments per group of batch elements: ``groups`` holds ``(rows, segments)``
    with ``rows`` a slice of the flattened batch."""

    groups: tuple[tuple[slice, tuple[Segment, ...]], ...]

    @property
    def num_segments(self) -> int:
        return sum(len(segments) for _, segments in self.groups)


def supported_structure(mask: Any) -> str | None:
    """Why ``mask``'s structure has no segment plan, or None (read without values)."""
    if mask is not None and len(mask.parts_of("documents")) > 1:
        return "more than one documents mask"
    return None


def plan_of(inputs: AttentionInputs) -> Plan | None:
    """The call's segments, or None when its ids are unreadable or not block diagonal.
    Without a documents mask every batch element is one segment."""
    import numpy as np

    mask = inputs.mask
    lq, lk = inputs.q_len, inputs.kv_len
    rows = math.prod(inputs.batch_shape)
    docs = () if mask is None else mask.parts_of("documents")
    if not docs:
        q_ids, k_ids = np.zeros((1, lq), dtype=np.int64), np.zeros((1, lk), dtype=np.int64)
    elif docs[0].ids_on_host() is None:
        return None
    else:
        q_ids, k_ids = (_flat(ids, n) for ids, n in zip(docs[0].ids_on_host(), (lq, lk),
                                                         strict=True))
    k_len = _limits(mask, "key_lengths", rows, lk)
    q_len = _limits(mask, "query_lengths", rows, lq)
    if k_len is None or q_len is None:
        return None
    band = None if mask is None else mask.band(lq, lk)
    upper = None if band is None else band.normalized(lq, lk).upper
    # batch elements with the same ids and lengths share a plan (one call for all)
    keys = [(b % len(q_ids), b % len(k_ids), k_len[b], q_len[b]) for b in range(rows)]
    found: dict[tuple, tuple[Segment, ...] | None] = {}
    for key in dict.fromkeys(keys):
        qi, ki, kl, ql = key
        found[key] = _segments(q_ids[qi], k_ids[ki], kl, ql, upper)
        if found[key] is None:
            return None
    if len(found) == 1:
        return Plan(((slice(None), next(iter(found.values()))),))
    return Plan(tuple((slice(b, b + 1), found[key]) for b, key in enumerate(keys)))


def _flat(ids: Any, length: int) -> Any:
    """``(*batch | 1, L)`` ids as ``(rows | 1, L)`` int64."""
    import numpy as np

    ids = np.asarray(ids, dtype=np.int64)
    return ids.reshape(math.prod(ids.shape[:-1]), length)


def _limits(mask: Any, kind: str, rows: int, length: int) -> list[int] | None:
    """The smallest of the ``kind`` parts' lengths per batch element (``length`` without
    one); None when a part's lengths cannot be read."""
    import numpy as np

    limit = np.full(rows, length, dtype=np.int64)
    for part in () if mask is None else mask.parts_of(kind):
        host = part.lengths_on_host()
        if host is None:
            return None
        limit = np.minimum(limit, np.asarray(host).reshape(rows))
    return [int(n) for n in limit]


def _runs(ids: Any) -> list[tuple[int, int, int]]:
    """``(id, start, stop)`` of each run of equal ids, in order."""
    import numpy as np

    if not ids.size:
        return []
    cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    starts = np.concatenate([[0], cuts])
    stops = np.concatenate([cuts, [ids.size]])
    return [(int(ids[s]), int(s), int(e)) for s, e in zip(starts, stops, strict=True)]


def _segments(q_ids: Any, k_ids: Any, k_len: int, q_len: int,
              upper: int | None) -> tuple[Segment, ...] | None:
    """One batch element's segments; None when a document's keys are not contiguous."""
    keys: dict[int, tuple[int, int]] = {}
    for doc, k0, k1 in _runs(k_ids[:k_len]):
        if doc < 0:
            continue
        if doc in keys:
            return None
        keys[doc] = (k0, k1)
    segments = []
    for doc, q0, q1 in _runs(q_ids[:q_len]):
        if doc < 0 or doc not in keys:
            continue
        k0, k1 = keys[doc]
        segment = _causal(q0, q1, k0, k1, upper)
        if segment is not None:
            segments.append(segment)
    return tuple(segments)


def _causal(q0: int, q1: int, k0: int, k1: int, upper: int | None) -> Segment | None:
    """The segment of rows ``[q0, q1)`` and keys ``[k0, k1)`` under ``j - i <= upper``,
    trimmed to the rows that see a key and the keys some row sees; None if empty."""
    if upper is None:
        return Segment(q0, q1, k0, k1, None)
    shift = q0 + upper - k0  # row q0 + r sees keys k0 + c with c <= r + shift
    if shift < 0:  # the first -shift rows see no key
        q0, shift = q0 - shift, 0
    k1 = min(k1, k0 + (q1 - 1 - q0) + shift + 1)
    if q0 >= q1 or k0 >= k1:
        return None
    return Segment(q0, q1, k0, k1, None if shift >= k1 - k0 - 1 else shift)
