"""Where the arrays of a bound mask lie against the call's ``(*batch, H)`` axes.

Blocks of batch and head chunks need their own slice of every array a mask holds. Once
bound to a call, each kind's arrays start with the batch axes (and the heads, where
they vary by head) and end in axes of its own: positions, layout cells or score pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from portattn import masks

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["OWN_AXES", "Place", "leaves", "places"]

#: Trailing axes of a bound kind's arrays that are not batch or head axes (other
#: kinds: none, their arrays have the batch shape).
OWN_AXES = {"documents": 1, "global_tokens": 1, "block_layout": 2, "dense": 2}


@dataclass(frozen=True)
class Place:
    """One array of a mask: its kind and how many of its leading axes run along
    ``(*batch, H)`` (a size-1 one broadcasts)."""

    kind: str
    lead: int

    @property
    def pairs(self) -> bool:
        """An ``Lq x Lk`` array: read block by block, never whole."""
        return self.kind == "dense"


def leaves(mask: masks.Mask) -> Iterator[masks.Mask]:
    """The single kinds inside ``mask``, in the order of ``mask.arrays``."""
    if isinstance(mask, (masks.Intersection, masks.Union)):
        for member in mask.members:
            yield from leaves(member)
    else:
        yield mask


def places(mask: masks.Mask | None) -> list[Place]:
    """A :class:`Place` per array of a bound ``mask``, in the order of ``mask.arrays``."""
    found = []
    for leaf in () if mask is None else leaves(mask):
        for array in leaf.arrays:
            # a mask function's arguments are read whole, by any block
            lead = 0 if leaf.kind == "function" else array.ndim - OWN_AXES.get(leaf.kind, 0)
            found.append(Place(leaf.kind, lead))
    return found
