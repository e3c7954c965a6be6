"""Where the arrays of a bound mask lie against the call's ``(*batch, H)`` axes.

Blocks of batch and head chunks need their own slice of every array a mask holds. Once
bound to a call, each kind's arrays start with the batch axes (and the heads, where
they vary by head) and end in axes of its own: positions, layout cells or score pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

from portattn import masks

__all__ = ["Place", "places"]


@dataclass(frozen=True)
class Place:
    """One array of a mask: how many of its leading axes run along ``(*batch, H)`` (a
    size-1 one broadcasts), and whether it holds a value per pair (``Lq x Lk``: read
    block by block, never whole)."""

    lead: int
    pairs: bool = False


def places(mask: masks.Mask | None) -> list[Place]:
    """A :class:`Place` per array of a bound ``mask``, in the order of ``mask.arrays``."""
    found = []
    for leaf in masks.leaves(mask):
        for array in leaf.arrays:
            # arrays read whole (a mask function's arguments) run along no call axis
            own = leaf.own_axes
            found.append(Place(0 if own is None else array.ndim - own, leaf.pairs))
    return found
