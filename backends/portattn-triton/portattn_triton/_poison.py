"""Non-finite keys and values a visited tile may hide, kept from the rows it hides them
from (portattn's rule for non-finite inputs, kept on the device with no host sync).

A hidden pair still meets its weight 0 in a tile's products, and ``0 * NaN`` is NaN.
The forward loads such values as 0 in masked tiles and gives their keys a NaN score in
the rows that attend them (``Poison``); the backward zeroes such keys and values and
adds the same NaN to those rows' scores (``Bad``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_BLOCK_N", "cut_keys", "not_finite", "value_poison"]

#: The widest key tile of any path, forward or backward.
MAX_BLOCK_N = 256


def cut_keys(lower: int | None, upper: int | None, q_len: int,
             kv_len: int) -> tuple[int, int] | None:
    """The keys ``[a, b)`` that the band hides from some row while a tile the kernels
    read holds them (None: there are none), a superset for any tile size.

    A hidden key still meets its weight 0 in a tile's products, and ``0 * NaN`` is NaN.
    Keys hidden by the lower bound are the first ``q_len - 1 + lower``, read from the
    first tile the band reaches; keys hidden by the upper bound come after ``upper``,
    read up to the last tile it reaches. So ``O(q_len + MAX_BLOCK_N)`` keys a side,
    and none for a decode step under a causal mask. (Keys past the lengths are never
    read by the forward and zeroed before the backward.)
    """
    spans = []
    if lower is not None:
        spans.append((max(lower, 0) // MAX_BLOCK_N * MAX_BLOCK_N,
                      min(q_len - 1 + lower, kv_len)))
    if upper is not None:
        spans.append((max(upper + 1, 0),
                      min(-(-(q_len + upper) // MAX_BLOCK_N) * MAX_BLOCK_N, kv_len)))
    spans = [(a, b) for a, b in spans if a < b]
    if not spans:
        return None
    return min(a for a, _ in spans), max(b for _, b in spans)


def not_finite(x: Any, cut: tuple[int, int] | None) -> Any:
    """``(Z, H, L)`` float32: NaN where row ``j`` of ``x (Z, H, L, E)`` holds NaN or inf,
    for ``j`` in ``cut`` (None: no row), 0 elsewhere. One pass over those rows: a
    row's extremes are both finite iff all of it is, and ``0 * y`` is 0 for finite
    ``y``, NaN otherwise."""
    import torch

    flags = torch.zeros(x.shape[:3], dtype=torch.float32, device=x.device)
    if cut is None:
        return flags
    a, b = cut
    low, high = torch.aminmax(x[..., a:b, :], dim=-1)
    flags[..., a:b] = low.float() * 0 + high.float() * 0
    return flags


def value_poison(v: Any, cut: tuple[int, int] | None) -> Any:
    """The forward kernels' ``Poison`` (None when no key needs it): NaN for each key in
    ``cut`` (the keys a visited tile may hide from some row) whose value row is not
    finite. In masked tiles they load such values as 0 and make their keys score NaN
    (see ``fold_tile``), so exactly the rows that attend such a value come out NaN, in
    every column. (A non-finite key needs nothing: its scores are replaced where
    hidden.)"""
    return None if cut is None else not_finite(v, cut)
