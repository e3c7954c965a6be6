"""What kernels ask of a mask's structure, answered in one place.

A kernel reads any mask through its block form; some also run a structure of their own
faster (a band with global tokens in three parts, lengths as arguments of a library's
own attention). They ask here, so that no kernel matches on kind names or reads a
kind's fields, and each split is written once. Every answer follows from the structure
alone (no values are read), so ``not_supported_reasons`` may ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._base import POSITIONAL, Intersection, Union, leaves

if TYPE_CHECKING:
    from ._base import Band, Mask

__all__ = ["BandAndLengths", "BandAndTokens", "band_and_lengths", "band_and_tokens",
           "head_dependence", "intersection", "is_positional", "reads_positions_alone"]

_PADDING = frozenset({"key_lengths", "query_lengths"})
_RELATIVE = frozenset({"causal", "sliding_window", "sink_tokens", "chunks"})


def is_positional(mask: Mask | None) -> bool:
    """Whether ``mask`` is made of causal and sliding-window parts only (all of it is
    :meth:`~portattn.masks.Mask.band`); no mask is not.

    Example:
        >>> from portattn import masks
        >>> masks.is_positional(masks.causal() & masks.sliding_window(4))
        True
        >>> masks.is_positional(masks.causal() | masks.sink_tokens(2))
        False
    """
    return mask is not None and all(p.kind in POSITIONAL for p in mask.parts)


def reads_positions_alone(mask: Mask | None) -> bool:
    """Whether ``mask`` holds no arrays and reads only a query's position and a key's,
    query ``i`` of ``n`` sitting at ``Lk - n + i``: it means the same in each sequence
    of a packed or paged batch, at that sequence's own length (causal, sliding windows,
    sink tokens and chunks, bottom-right aligned, combined with ``&`` and ``|``). So
    does no mask (None).

    Example:
        >>> from portattn import masks
        >>> masks.reads_positions_alone(masks.causal() | masks.sink_tokens(4))
        True
        >>> masks.reads_positions_alone(masks.causal("top_left"))
        False
    """
    return mask is None or all(
        p.kind in _RELATIVE and getattr(p, "alignment", "bottom_right") == "bottom_right"
        and not getattr(p, "shift", 0) and not getattr(p, "origin", 0)
        for p in leaves(mask))


@dataclass(frozen=True)
class BandAndTokens:
    """A mask ``band | global_tokens(positions)`` in its two parts.

    ``band`` is the positional part (None: every key), ``tokens`` the
    :class:`~portattn.masks.GlobalTokens` part (None: no global tokens), with positions
    of the whole call."""

    band: Mask | None
    tokens: Any

    def key_band(self, lq: int, lk: int) -> Band | None:
        """The positional part as one normalised band; None without one (the global
        tokens alone)."""
        return None if self.band is None else self.band.band(lq, lk).normalized(lq, lk)


def band_and_tokens(mask: Mask | None) -> BandAndTokens | None:
    """``mask`` as a positional band joined to global tokens (``band | tokens``, either
    part may be missing; no mask is neither), or None when it is anything else or its
    tokens were cut from a larger call (their positions are not this call's).

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> split = masks.band_and_tokens(masks.sliding_window(2)
        ...                               | masks.global_tokens(np.array([0])))
        >>> split.band, split.tokens.kind
        (sliding_window(left=2, right=0), 'global_tokens')
        >>> masks.band_and_tokens(masks.documents(np.array([0, 0, 1]))) is None
        True
    """
    if mask is None:
        return BandAndTokens(None, None)
    members = mask.members if isinstance(mask, Union) else (mask,)
    bands = [p for p in members if is_positional(p)]
    tokens = [p for p in members if p.kind == "global_tokens"]
    if len(bands) + len(tokens) != len(members) or len(bands) > 1 or len(tokens) > 1:
        return None
    if tokens and not tokens[0].whole_call:
        return None
    return BandAndTokens(bands[0] if bands else None, tokens[0] if tokens else None)


@dataclass(frozen=True)
class BandAndLengths:
    """A mask as what attention functions take as arguments, and the rest: the band of
    its causal and sliding-window parts (None: none), the lengths of its
    ``key_lengths`` and ``query_lengths`` parts (a key or query must lie below each),
    and its other parts, whose pairs must come from their tiles."""

    band: Band | None
    key_lengths: tuple[Any, ...]
    query_lengths: tuple[Any, ...]
    rest: tuple[Mask, ...]


def band_and_lengths(mask: Mask | None, lq: int, lk: int) -> BandAndLengths:
    """``mask`` (bound to a call of ``lq`` queries and ``lk`` keys) split into a band,
    padding lengths and the rest; the intersection of the three is the mask.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.causal() & masks.key_lengths(np.array([3])) & masks.chunks(2)
        >>> split = masks.band_and_lengths(mask, 4, 4)
        >>> split.band, [a.tolist() for a in split.key_lengths], split.rest
        (Band(lower=None, upper=0), [[3]], (chunks(2),))
    """
    if mask is None:
        return BandAndLengths(None, (), (), ())
    return BandAndLengths(mask.band(lq, lk),
                          tuple(p.lengths for p in mask.parts_of("key_lengths")),
                          tuple(p.lengths for p in mask.parts_of("query_lengths")),
                          tuple(p for p in mask.parts
                                if p.kind not in POSITIONAL and p.kind not in _PADDING))


def head_dependence(mask: Mask | None) -> str | None:
    """Why ``mask`` may allow other pairs for other query heads (a mask function, which
    may read the head index; a dense mask or a layout with a heads axis); None when
    every head sees the same pairs.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.head_dependence(masks.causal()) is None
        True
        >>> masks.head_dependence(masks.dense(np.ones((2, 4, 4), bool)))
        'dense array of shape (2, 4, 4) varies by head'
    """
    for part in leaves(mask):
        if part.kind == "function":
            return f"{part!r} may read the head index (a function mask)"
        if part.own_axes == 2:  # (*batch, H, rows, columns)
            shape = tuple(part.arrays[0].shape)
            if len(shape) >= 3 and shape[-3] != 1:
                return f"{part.kind} array of shape {shape} varies by head"
    return None


def intersection(parts: tuple[Mask, ...]) -> Mask | None:
    """``parts`` (e.g. ``BandAndLengths.rest``) as one mask, their intersection;
    None for no parts.

    Example:
        >>> from portattn import masks
        >>> masks.intersection((masks.chunks(4), masks.sink_tokens(1)))
        chunks(4) & sink_tokens(1)
        >>> masks.intersection(()) is None
        True
    """
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else Intersection(tuple(parts))
