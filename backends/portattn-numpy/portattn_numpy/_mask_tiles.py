"""What the mask says of one unit's batch element and head, where its block form
leaves tiles partial: the pairs of a tile (``allowed``, from the mask's ``tile``) and
the block form of a part on a finer grid (``states``).

Key blocks that most rows of tiles leave partial (a global token's column) are read
over every query once per call and kept, rather than unit by unit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import PARTIAL, Grid

if TYPE_CHECKING:
    from ._memo import CallPlans
    from ._problem import Problem

__all__ = ["UnitMask", "head_view"]

#: Share of the rows of tiles a key block must leave partial for its tile to be read
#: over every query once per call (a global token's column) rather than unit by unit.
_COLUMN = 0.75


def _columns(p: Problem, plans: CallPlans) -> Any:
    """Which key blocks of the call's grid are read over every query at once."""
    found = plans.local.get("columns")
    if found is None:
        partial = p.blocks.states == PARTIAL
        found = plans.local["columns"] = partial.reshape(-1, partial.shape[-1]).mean(
            axis=0) >= _COLUMN
    return found


def head_view(full: Any, b: tuple[int, ...], h: int) -> Any:
    """The ``(Lq|1, Lk|1)`` slice of a full-rank broadcastable array for one head."""
    lead = tuple(0 if size == 1 else i for i, size in zip(b, full.shape[:-3], strict=True))
    return full[(*lead, 0 if full.shape[-3] == 1 else h)]


class UnitMask:
    """What the mask says of one unit's batch element and head: the pairs of a tile
    (``allowed``) and the block form of a part on a finer grid (``states``), noting
    whether the mask varied where the call's block form does not (``shared``). What it
    reads for every unit is kept in the call's ``plans``."""

    def __init__(self, p: Problem, plans: CallPlans, b: tuple[int, ...], h: int,
                 q0: int) -> None:
        self.p, self.plans, self.b, self.h, self.q0 = p, plans, b, h, q0
        self.shared = True

    def allowed(self, r0: int, r1: int, k0: int, k1: int) -> Any:
        """``(rows, keys)`` booleans, True = attend, for the unit's rows ``r0:r1``."""
        p, q0 = self.p, self.q0
        step = p.blocks.block_k
        c0, c1 = k0 // step, -(-k1 // step)
        if _columns(p, self.plans)[c0:c1].all():  # read once per call, for every unit
            parts = [self._column(c) for c in range(c0, c1)]
            tile = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
            return tile[q0 + r0:q0 + r1, k0 - c0 * step:k1 - c0 * step]
        tile = np.asarray(p.mask.tile(np, q0 + r0, q0 + r1, k0, k1, p.q_len, p.kv_len))
        return np.broadcast_to(self._own(tile), (r1 - r0, k1 - k0))

    def _column(self, c: int) -> Any:
        """The tile of the call's key block ``c`` over every query, kept for the call."""
        p = self.p
        k0, k1 = c * p.blocks.block_k, min(p.kv_len, (c + 1) * p.blocks.block_k)
        tile = self.plans.local.get(("column", c))
        if tile is None:
            tile = self.plans.local["column", c] = np.asarray(
                p.mask.tile(np, 0, p.q_len, k0, k1, p.q_len, p.kv_len))
        return np.broadcast_to(self._own(tile), (p.q_len, k1 - k0))

    def states(self, r0: int, r1: int, k0: int, k1: int, rows: int,
               keys: int) -> tuple[Any, Any, Any] | None:
        """``(states, row edges, key edges)``: the block form of the unit's rows ``r0:r1``
        and keys ``k0:k1`` in tiles of ``rows x keys``; None where the mask cannot tell."""
        p, q0 = self.p, self.q0
        q_edges = np.append(np.arange(q0 + r0, q0 + r1, rows), q0 + r1)
        k_edges = np.append(np.arange(k0, k1, keys), k1)
        states = p.mask.block_states(Grid(q_edges, k_edges, p.q_len, p.kv_len))
        if states is None:
            return None
        shape = (len(q_edges) - 1, len(k_edges) - 1)
        return np.broadcast_to(self._own(np.asarray(states)), shape), q_edges - q0, k_edges

    def _own(self, a: Any) -> Any:
        """This batch element's and head's part of ``a`` (full rank when it has leading
        axes, which broadcast against ``(*batch, H)``)."""
        if a.ndim <= 2:
            return a
        rank = len(self.b) + 3
        a = a.reshape((1,) * (rank - a.ndim) + a.shape)
        states = self.p.blocks.states.shape[:-2]
        states = (1,) * (rank - 2 - len(states)) + states
        if any(t > 1 and s == 1 for t, s in zip(a.shape[:-2], states, strict=True)):
            self.shared = False
        return head_view(a, self.b, self.h)
