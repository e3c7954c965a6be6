"""Bit tiles: the elementwise mask of the partial tiles, for the mask kinds that have no
in-kernel formula (everything but the band and the lengths).

Each slot is one tile ``block_q x block_k`` of one batch element and head (where the
mask varies), evaluated on the device with the mask's ``allows`` at the tile's indices,
many tiles per call, and packed eight keys to a byte: slot ``s``, row ``r``, key ``c``
is bit ``c % 8`` of ``bits[s, r, c // 8]``. Memory is O(partial tiles x tile size):
packed documents cost only the tiles on their boundaries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from portattn.masks import Mask

__all__ = ["bit_tiles", "varies"]

#: Pairs evaluated per call of ``allows`` (bounds the index arrays' memory).
CHUNK_PAIRS = 1 << 22


def varies(mask: Mask, xp: Any, device: Any, batch: int, heads: int, q_len: int,
           kv_len: int) -> tuple[int, int]:
    """``(Z|1, H|1)``: whether ``mask.allows`` depends on the batch element and the
    head, from the shape of its answer at one pair for every batch element and head."""
    b = xp.reshape(xp.arange(batch, device=device), (batch, 1, 1, 1))
    h = xp.reshape(xp.arange(heads, device=device), (1, heads, 1, 1))
    zero = xp.zeros((1, 1, 1, 1), dtype=b.dtype, device=device)
    shape = tuple(getattr(mask.allows(xp, b, h, zero, zero, q_len, kv_len), "shape", ()))
    shape = (1,) * (4 - len(shape)) + shape
    return (batch if shape[0] > 1 else 1), (heads if shape[1] > 1 else 1)


def bit_tiles(mask: Mask, xp: Any, device: Any, to_torch: Callable[[Any], Any],
              torch_device: Any, coords: Any, block_q: int, block_k: int, q_len: int,
              kv_len: int, decode_group: int | None = None) -> Any:
    """Packed bits ``(S, block_q, block_k // 8)`` uint8 (torch, on ``torch_device``) of
    the tiles at ``coords`` ``(S, 4)``: ``(batch element, head, query block, key block)``
    (batch element and head 0 where the mask does not vary along them). With
    ``decode_group``, the query block is the decode tile: row ``r`` is query
    ``r % q_len`` of head ``head * decode_group + r // q_len``."""
    import numpy as np
    import torch

    count = len(coords)
    bits = torch.empty((max(count, 1), block_q, block_k // 8), dtype=torch.uint8,
                       device=torch_device)
    if count == 0:
        return bits
    rows, keys = np.arange(block_q), np.arange(block_k)
    step = max(1, CHUNK_PAIRS // (block_q * block_k))
    weights = torch.arange(8, device=torch_device, dtype=torch.int32)
    for first in range(0, count, step):
        part = coords[first:first + step]
        z, h, a, b = (part[:, i:i + 1] for i in range(4))
        if decode_group is None:
            q, heads = a * block_q + rows, h
        else:
            q = np.broadcast_to(rows % q_len, (len(part), block_q))
            heads = h * decode_group + np.minimum(rows // q_len, decode_group - 1)
        k = b * block_k + keys
        # (S, 1, 1), (S, 1 | block_q, 1), (S, block_q, 1), (S, 1, block_k); padding rows
        # and keys read the last valid index (the kernels mask them by the lengths)
        index = (z[..., None], heads[..., None], np.clip(q, 0, q_len - 1)[..., None],
                 np.clip(k, 0, kv_len - 1)[:, None, :])
        arrays = [xp.asarray(i, device=device) for i in index]
        allowed = mask.allows(xp, *arrays, q_len, kv_len)
        if not hasattr(allowed, "shape"):  # a mask function that answers one bool
            allowed = xp.asarray(allowed, device=device)
        allowed = xp.broadcast_to(xp.astype(allowed, xp.uint8), (len(part), block_q, block_k))
        tiles = to_torch(allowed).to(torch_device, torch.int32)
        tiles = tiles.reshape(len(part), block_q, block_k // 8, 8)
        bits[first:first + len(part)] = (tiles << weights).sum(-1).to(torch.uint8)
    return bits
