"""Score changes by distance (``portattn.scores``): T5's relative positions, learned
ALiBi slopes and their sums, whose entries depend on the distance ``j - i`` alone.

The kernels read such a change as its ``by_distance`` array, made once per call in
float32: ``(Hq, Lq + Lk - 1)``, the entry of query ``i`` and key ``j`` at ``j - i +
Lq - 1`` (``_triton_distance``), each row padded with :data:`PAD` zeros on both sides
so that any tile of the kernels' grids reads inside it without a mask (a mask per pair
costs the kernels registers they do not have). It joins the scores where a bias does. For its
gradient the dQ pass writes each tile's diagonal sums of the score gradient into slices
of a buffer that only its program writes (:func:`gradient_buffer`); one fixed-order sum
here (:func:`distance_gradient`) gives the gradient of that array, and the change's own
``distance_gradients`` (products with one-hot matrices, no scatter) maps it to the
tables: the same bits on every run. Other kinds (pair tables, Swin's window table) do
not follow the distance: the kernel does not declare them (``score_mod``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from portattn.scores import ScoreChange

__all__ = ["KINDS", "PAD", "ByDistance", "by_distance", "check_tiles", "distance_gradient",
           "gradient_buffer", "table_gradients"]

#: The kinds of score change the kernels take (``Kernel.score_mod``): those by distance.
KINDS = frozenset({"relative_position", "alibi"})

#: Zeros on each side of a row: at least a tile's side less one, for the widest tiles
#: the launchers and the autotuner use (the pairs they reach there are never kept).
PAD = 256


@dataclass(frozen=True)
class ByDistance:
    """A call's score change (bound to it) and its entries by distance."""

    change: ScoreChange
    values: Any
    """``(Hq, PAD + Lq + Lk - 1 + PAD)`` float32 torch tensor, contiguous, on the call's
    device: the entries by distance, padded with zeros."""


def by_distance(change: ScoreChange, xp: Any, q_len: int, kv_len: int, to_torch: Any,
                device: Any) -> ByDistance:
    """The bound ``change``'s entries by distance, made in the caller's library ``xp``
    and carried to ``device`` as float32, padded (no gradient is recorded: the kernels'
    own backward gives the tables theirs)."""
    import torch

    with torch.no_grad():
        values = to_torch(change.by_distance(xp, q_len, kv_len))
        values = torch.nn.functional.pad(
            values.to(device=device, dtype=torch.float32), (PAD, PAD)).contiguous()
    return ByDistance(change, values)


def check_tiles(*sides: int) -> None:
    """Refuse tiles with a side longer than the padding holds (a fixed ``Config``)."""
    if max(sides) > PAD:
        msg = (f"a score change by distance takes tiles of at most {PAD} queries and "
               f"keys; got a tile side of {max(sides)}")
        raise ValueError(msg)


def _slices(block_m: int, block_n: int) -> int:
    """As ``_triton_distance._slices``."""
    return (block_m + block_n - 2) // block_n + 1


def _width(kv_len: int, block_m: int, block_n: int) -> int:
    """As ``_triton_distance._width``."""
    return math.ceil(kv_len / block_n) * block_n + block_m - 1


def gradient_buffer(programs: int, q_len: int, kv_len: int, block_m: int, block_n: int,
                    device: Any) -> Any:
    """Zeros for the dQ pass's diagonal sums: per program (``programs`` batch elements
    and heads, times the query blocks), slices of the diagonals its query block meets.
    ``Z * Hq * cdiv(Lq, block_m) * slices * (Lk + block_m)`` float32: far less than a
    bias's ``Lq x Lk`` gradient, more than the ``(Hq, Lq + Lk - 1)`` it sums to."""
    import torch

    shape = (programs, math.ceil(q_len / block_m), _slices(block_m, block_n),
             _width(kv_len, block_m, block_n))
    return torch.zeros(shape, dtype=torch.float32, device=device)


def distance_gradient(buffer: Any, heads: int, q_len: int, kv_len: int,
                      block_m: int) -> Any:
    """The gradient of the ``(Hq, Lq + Lk - 1)`` array from the buffer the dQ pass
    wrote: summed over batch elements and slices, then each query block's diagonals
    moved to where they start in the call, in one fixed order."""
    programs, blocks, _, width = buffer.shape
    per_block = buffer.view(programs // heads, heads, blocks, -1, width).sum(dim=(0, 3))
    # Block b's first diagonal is the call's Lq - block_m * (b + 1): the last block
    # starts lowest, ``pad`` (its rows past Lq) before the call's first diagonal.
    placed = _shifted_sum(per_block.flip(1), block_m)
    pad = blocks * block_m - q_len
    return placed[:, pad:pad + q_len + kv_len - 1]


def _shifted_sum(rows: Any, step: int) -> Any:
    """``(H, (n - 1) * step + w)``: the sum of ``rows (H, n, w)``, row ``r`` moved
    ``r * step`` along. Padded each with ``n * step`` zeros and read ``step`` shorter
    per row, the rows fall into place (copies and one sum: no scatter)."""
    import torch

    heads, n, width = rows.shape
    padded = torch.nn.functional.pad(rows, (0, n * step))
    length = width + (n - 1) * step
    skewed = padded.reshape(heads, -1)[:, :n * length].reshape(heads, n, length)
    return skewed.sum(dim=1)


def table_gradients(distance: ByDistance, gradient: Any, wanted: tuple[bool, ...],
                    q_len: int, kv_len: int) -> tuple[Any, ...]:
    """Each array of the change's gradient (None where not ``wanted``, or where the
    change gives none) from ``gradient``, that of the by-distance array (None: zero)."""
    import torch
    from array_api_compat import array_namespace

    change = distance.change
    arrays = change.arrays
    if gradient is None:
        grads = tuple(torch.zeros_like(a) for a in arrays)
    else:
        xp = array_namespace(gradient)
        grads = change.distance_gradients(xp, gradient, q_len, kv_len, torch.float32)
    return tuple(None if g is None or not w else g.to(a.dtype)
                 for g, a, w in zip(grads, arrays, wanted, strict=True))
