"""The block form of a call as the tables the Triton kernels read (NumPy, on the host).

A kernel program reads one row of a table: for its query block (or, transposed, its
key block) the number of partial and of full tiles, the partial tiles' block indices,
the slot of each one's bit tile (-1: the band and length formulas alone mask it) and
the full tiles' block indices::

    [n_partial, n_full, partial[0:C], slot[0:C], full[0:C]]      (C: blocks in a row)

Tables are ``(Z|1, H|1, R, 2 + 3C)`` int32: a leading axis of size 1 is read with stride
0, so a mask that does not vary per batch element or head keeps one row per block.
"""

from __future__ import annotations

import math
from typing import Any

from portattn.masks import FULL, HIDDEN, PARTIAL

__all__ = ["demote_ragged", "group_states", "per_batch_and_head", "slot_grid", "split_rows",
           "table"]


def per_batch_and_head(states: Any, batch_shape: tuple[int, ...], heads: int) -> Any:
    """Block states ``(*lead, R, C)`` (``lead`` broadcasting against ``(*batch, H)``)
    as ``(Z|1, H|1, R, C)``: the batch axes flattened where they vary, else size 1."""
    import numpy as np

    rows, cols = states.shape[-2:]
    rank = len(batch_shape) + 1
    lead = (1,) * (rank - states.ndim + 2) + tuple(states.shape[:-2])
    states = states.reshape(*lead, rows, cols)
    head = lead[-1]
    if any(n != 1 for n in lead[:-1]):
        states = np.broadcast_to(states, (*batch_shape, head, rows, cols))
        return states.reshape(math.prod(batch_shape), head, rows, cols)
    return states.reshape(1, head, rows, cols)


def unify(*arrays: Any) -> list[Any]:
    """``(Z|1, H|1, R, C)`` arrays broadcast to their common leading axes."""
    import numpy as np

    lead = np.broadcast_shapes(*(a.shape[:2] for a in arrays))
    return [np.broadcast_to(a, (*lead, *a.shape[2:])) for a in arrays]


def demote_ragged(states: Any, q_len: int, kv_len: int, block_q: int, block_k: int,
                  every: bool = False) -> Any:
    """``states`` with the full tiles that reach past ``q_len`` or ``kv_len`` (the last
    block of a ragged axis) made partial, so that the kernels read every full tile whole,
    with no bounds; with ``every``, all full tiles (a bias is read in the masked loop)."""
    import numpy as np

    states = np.array(states, dtype=np.int8)
    if every:
        states[states == FULL] = PARTIAL
        return states
    if q_len % block_q:
        last = states[..., -1, :]
        last[last == FULL] = PARTIAL
    if kv_len % block_k:
        last = states[..., :, -1]
        last[last == FULL] = PARTIAL
    return states


def group_states(states: Any, group: int) -> Any:
    """``(Z|1, H|1, R, C)`` merged over the query heads of each K/V head (the decode
    tile packs them): hidden where hidden for all, full where full for all."""
    import numpy as np

    z, h, rows, cols = states.shape
    if h == 1:
        return states
    grouped = states.reshape(z, h // group, group, rows, cols)
    high, low = grouped.max(axis=2), grouped.min(axis=2)
    return np.where(high == HIDDEN, HIDDEN, np.where(low == FULL, FULL, PARTIAL)).astype(np.int8)


def slot_grid(states: Any, rest: Any) -> tuple[Any, Any]:
    """``(slots, coordinates)``: for each tile partial in ``states`` and not full in the
    bit-tile part's states ``rest`` (same shape), its slot in the bit tiles, -1 elsewhere;
    and the ``(z, h, row, col)`` of each slot, ``(S, 4)``."""
    import numpy as np

    need = (states == PARTIAL) & (rest != FULL)
    slots = np.full(states.shape, -1, dtype=np.int32)
    where = np.nonzero(need)
    slots[where] = np.arange(len(where[0]), dtype=np.int32)
    return slots, np.stack(where, axis=-1).astype(np.int64)


def table(states: Any, slots: Any) -> Any:
    """The table rows (see the module doc) of ``states`` and ``slots`` ``(..., R, C)``."""
    import numpy as np

    partial, full = states == PARTIAL, states == FULL
    order_partial = np.argsort(~partial, axis=-1, kind="stable")
    order_full = np.argsort(~full, axis=-1, kind="stable")
    parts = [partial.sum(-1)[..., None], full.sum(-1)[..., None], order_partial,
             np.take_along_axis(slots, order_partial, axis=-1), order_full]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1), dtype=np.int32)


def split_rows(states: Any, slots: Any, splits: int, per_split: int) -> Any:
    """The decode table: one query block ``(..., 1, C)`` cut into ``splits`` rows of
    ``per_split`` key blocks each, listing global key block indices."""
    import numpy as np

    *lead, _, cols = states.shape
    width = splits * per_split
    padded = np.full((*lead, width), HIDDEN, dtype=np.int8)
    padded[..., :cols] = states[..., 0, :]
    padded_slots = np.full((*lead, width), -1, dtype=np.int32)
    padded_slots[..., :cols] = slots[..., 0, :]
    rows = table(padded.reshape(*lead, splits, per_split),
                 padded_slots.reshape(*lead, splits, per_split))
    offsets = (np.arange(splits, dtype=np.int32) * per_split)[:, None]
    for start in (2, 2 + 2 * per_split):  # block indices, local to the split: made global
        rows[..., start:start + per_split] += offsets
    return rows
