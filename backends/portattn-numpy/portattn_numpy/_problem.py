"""One call as plain data: its NumPy arrays, scale, softcap, mask, score change and the
sizes it is cut into; and one head's view of an array that broadcasts over the heads.

How it is computed is kept apart, in its plan (``_units.Plan``, made by ``_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from portattn.masks import BlockMask, Mask

__all__ = ["Problem", "head_view"]


@dataclass(frozen=True)
class Problem:
    """What one call is, as the workers share it."""

    query: Any
    key: Any
    value: Any
    out: Any
    """``(*batch, Hq, Lq, Dv)``, zeros: rows no unit touches keep output 0."""
    lse: Any
    """``(*batch, Hq, Lq)`` filled with ``-inf``, or None when not asked for."""
    factor: float
    """Multiplies the queries: the scale, divided by the softcap when there is one,
    times ``log2(e)`` in base 2 without a softcap."""
    softcap: float | None
    """Multiplies ``tanh`` of the scores (times ``log2(e)`` in base 2)."""
    base2: bool
    """Whether scores are in base 2 (``log2(e)`` folded in) and go through an ``exp2``."""
    query_ready: bool
    """Whether BLAS can read the query's rows in place (else they are copied)."""
    bias: Any
    mask: Mask | None
    """The call's mask, bound to it: its ``tile`` masks the partial tiles."""
    blocks: BlockMask | None
    """The mask's block form on the fine grid (``Config.mask_step`` rows by
    ``Config.mask_chunk`` keys), what units and their blocks are planned from; None
    without a mask."""
    q_len: int
    kv_len: int
    group: int
    """Query heads per key/value head."""
    block_q: int
    block_k: int
    tile_elements: int
    """Entries of one score tile (``Config.score_tile_bytes`` over the item size)."""
    change: Any = None
    """The call's score change as the loops add it (a ``_changes.Shift``, which reads
    this module's views), or None."""

    @cached_property
    def spans(self) -> tuple[Any, Any] | None:
        """Each row's one run of keys (``Mask.key_spans``: ``(start, stop)``, shaped
        ``(*lead, Lq)``), where the mask has them; read once, by the first plan that
        asks."""
        return None if self.mask is None else self.mask.key_spans(self.q_len, self.kv_len)


def head_view(full: Any, b: tuple[int, ...], h: int) -> Any:
    """The ``(Lq|1, Lk|1)`` slice of a full-rank broadcastable array for one head."""
    lead = tuple(0 if size == 1 else i for i, size in zip(b, full.shape[:-3], strict=True))
    return full[(*lead, 0 if full.shape[-3] == 1 else h)]
