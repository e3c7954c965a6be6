"""How ``numpy_fast`` treats each kind of mask part.

Every kind the kernel declares is in :data:`KINDS`, mapped to one treatment:

* ``POSITIONAL``: the part depends on query and key positions only (the same for
  every batch element and head). Its ``key_range`` bounds each unit's keys, its
  ``covers`` tells which blocks need no masking, its ``tile`` masks the rest; what it
  decides is remembered across heads and calls (``_blocks``).
* ``KEY_LENGTHS`` / ``QUERY_LENGTHS``: per-batch valid lengths (``part.lengths``), read
  once; rows and keys past them are never computed.
* ``PER_ELEMENT``: anything else. The part's ``tile`` over the whole call is read once
  as a full-rank boolean array (True = attend), like a dense mask: blocks it leaves
  empty are skipped, the others masked element by element.

To add a mask kind: give its class the public ``Mask`` methods (``key_range``,
``covers``, ``tile``), map its ``kind`` here to the treatment that fits (when unsure,
``PER_ELEMENT`` is always right, only slower), and the kernel declares it from this
table; its conformance tests then run it (``tests/test_numpy_fast_conformance.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from portattn.masks import Mask

__all__ = ["KEY_LENGTHS", "KINDS", "PER_ELEMENT", "POSITIONAL", "QUERY_LENGTHS", "Parts",
           "split"]

POSITIONAL = "positional"
KEY_LENGTHS = "key_lengths"
QUERY_LENGTHS = "query_lengths"
PER_ELEMENT = "per_element"

KINDS = {
    "causal": POSITIONAL,
    "sliding_window": POSITIONAL,
    "key_lengths": KEY_LENGTHS,
    "query_lengths": QUERY_LENGTHS,
    "dense": PER_ELEMENT,
}


@dataclass(frozen=True)
class Parts:
    """A call's mask, sorted by treatment."""

    positional: tuple[Mask, ...] = ()
    key_len: Any = None
    """Per-batch key lengths (the smallest over the parts), or None."""
    query_len: Any = None
    dense: tuple[Any, ...] = ()
    """Full-rank boolean arrays (True = attend) of the per-element parts."""

    @property
    def skip_tiles(self) -> bool:
        """Whether the structure alone rules out some tiles (causal, window, lengths)."""
        return bool(self.positional) or self.key_len is not None or self.query_len is not None


def split(mask: Mask | None, q_len: int = 0, kv_len: int = 0) -> Parts:
    """``mask``'s parts by treatment (``q_len``/``kv_len``: the call's lengths)."""
    if mask is None:
        return Parts()
    import numpy as np  # here: the kernel's declarations read KINDS without NumPy

    by: dict[str, list[Mask]] = {}
    for part in mask.parts:
        by.setdefault(KINDS[part.kind], []).append(part)

    def smallest(treatment: str) -> Any:
        arrays = [np.asarray(p.lengths) for p in by.get(treatment, ())]
        return functools.reduce(np.minimum, arrays) if arrays else None

    return Parts(
        positional=tuple(by.get(POSITIONAL, ())),
        key_len=smallest(KEY_LENGTHS), query_len=smallest(QUERY_LENGTHS),
        dense=tuple(np.asarray(p.tile(np, 0, q_len, 0, kv_len, q_len, kv_len))
                    for p in by.get(PER_ELEMENT, ())))
