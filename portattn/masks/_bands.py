"""Masks defined by positions alone, as one band of key offsets per query row:
:class:`Causal` and :class:`SlidingWindow` (both bottom-right aligned by default)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from ._base import Band, Mask, replaced

__all__ = ["Causal", "SlidingWindow"]


class _Positional(Mask):
    """Masks defined by query/key positions only: everything follows from the band.

    ``shift`` moves the query positions further; it is how :meth:`Mask.restrict` keeps a
    sub-problem aligned with the whole.
    """

    shift: int

    def offset(self, lq: int, lk: int) -> int:
        """Absolute position of query 0 (key ``j`` sits at ``j``) for these lengths."""
        return self._base(lq, lk) + self.shift

    def _base(self, lq: int, lk: int) -> int:
        return lk - lq

    def band(self, lq, lk):
        raise NotImplementedError

    def key_range(self, q0, q1, lq, lk):
        return self.band(lq, lk).key_range(q0, q1, lk)

    def key_spans(self, lq, lk):
        return self.band(lq, lk).key_spans(lq, lk)

    def covers(self, q0, q1, k0, k1, lq, lk):
        return self.band(lq, lk).covers(q0, q1, k0, k1)

    def hides(self, q0, q1, k0, k1, lq, lk):
        return self.band(lq, lk).hides(q0, q1, k0, k1)

    def tile(self, xp, q0, q1, k0, k1, lq, lk, device=None):
        return self.band(lq, lk).tile(xp, q0, q1, k0, k1, device)

    def block_states(self, grid):
        return self.band(grid.q_len, grid.kv_len).block_states(grid)

    def allows(self, xp, b, h, q, k, lq, lk):
        return self.band(lq, lk).allows(q, k)

    def restrict(self, xp, q0, q1, k0, k1, lq, lk):
        # global position of local query i: (q0 + i) + offset; of local key j: k0 + j.
        shift = self.offset(lq, lk) + q0 - k0 - self._base(q1 - q0, k1 - k0)
        return replaced(self, shift=shift)

    def structure(self) -> tuple:
        return (self.kind, *(getattr(self, f.name) for f in fields(self)))

    def key(self) -> tuple:
        return self.structure()

    def _shift_text(self) -> str:
        return f", shift={self.shift}" if self.shift else ""


@dataclass(frozen=True, eq=False, repr=False)
class Causal(_Positional):
    """Query at absolute position ``p`` attends keys ``j <= p``; made by
    :func:`~portattn.masks.causal`.

    ``alignment`` places query ``i`` at ``p = i + Lk - Lq`` (``"bottom_right"``) or
    ``p = i`` (``"top_left"``); ``shift`` moves it further, which is how
    :meth:`~Mask.restrict` keeps a sub-problem aligned with the whole.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.causal()
        >>> mask.band(4, 6), masks.causal("top_left").band(4, 6)
        (Band(lower=None, upper=2), Band(lower=None, upper=0))
        >>> part = mask.restrict(np, 0, 2, 0, 3, 4, 6)  # queries [0, 2), keys [0, 3)
        >>> part
        causal(bottom_right, shift=1)
        >>> print(masks.text(part, 2, 3))
        ###
        ###
    """

    kind: ClassVar[str] = "causal"
    alignment: str = "bottom_right"
    shift: int = 0

    def __post_init__(self) -> None:
        if self.alignment not in ("bottom_right", "top_left"):
            msg = ("alignment must be 'bottom_right' or 'top_left'; got "
                   f"alignment={self.alignment!r}")
            raise ValueError(msg)

    def _base(self, lq, lk):
        return lk - lq if self.alignment == "bottom_right" else 0

    def band(self, lq, lk):
        return Band(None, self.offset(lq, lk))

    def __repr__(self) -> str:
        return f"causal({self.alignment}{self._shift_text()})"


@dataclass(frozen=True, eq=False, repr=False)
class SlidingWindow(_Positional):
    """Query at (bottom-right aligned) position ``p`` attends ``p-left <= j <= p+right``;
    made by :func:`~portattn.masks.sliding_window`.

    ``None`` leaves a side unbounded; ``shift`` is as for :class:`Causal`.

    Example:
        >>> from portattn import masks
        >>> mask = masks.sliding_window(1, 1)
        >>> mask.band(4, 4), mask.key_range(0, 2, 4, 4)
        (Band(lower=-1, upper=1), (0, 3))
        >>> print(masks.text(mask & masks.causal(), 4, 4))
        #...
        ##..
        .##.
        ..##
    """

    kind: ClassVar[str] = "sliding_window"
    left: int | None
    right: int | None = 0
    shift: int = 0

    def __post_init__(self) -> None:
        for name in ("left", "right"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                msg = f"sliding_window {name} must be an int >= 0 or None; got {name}={value!r}"
                raise ValueError(msg)

    def band(self, lq, lk):
        offset = self.offset(lq, lk)
        return Band(None if self.left is None else offset - self.left,
                    None if self.right is None else offset + self.right)

    def __repr__(self) -> str:
        return f"sliding_window(left={self.left}, right={self.right}{self._shift_text()})"
