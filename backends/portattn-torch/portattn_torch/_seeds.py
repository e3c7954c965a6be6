"""Dropout seeds for torch (the ``seeds`` this plugin adds for torch, ``_library``): a call given no
``dropout_seed`` draws one from torch's generator for the tensors' device, so
``torch.manual_seed`` makes it repeatable, as for torch's own dropout; an unsigned
tensor seed (which torch cannot shift on the CPU) is handed to the core as signed
words of the same value."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["draw", "words"]

#: The signed dtype of each unsigned one's width, and how many of its entries make
#: the 128 bits a seed holds at most.
_SIGNED = {torch.uint32: (torch.int32, 4), torch.uint64: (torch.int64, 2)}


def draw(like: Any) -> Any:
    """Two int32 words drawn on ``like``'s device (no host sync on an accelerator)."""
    return torch.randint(-(1 << 31), (1 << 31) - 1, (2,), dtype=torch.int32,
                         device=like.device)


def words(seed: Any) -> Any:
    """An integer tensor of the same value the core splits into words with torch's
    operations (only ``uint8`` has shifts among the unsigned dtypes); other seeds as
    they are."""
    if seed.dtype == torch.uint16:
        return seed.to(torch.int32)  # every value fits
    if seed.dtype not in _SIGNED:
        return seed
    signed, full = _SIGNED[seed.dtype]
    bits = seed.reshape(-1).view(signed)  # the same bits, the top one read as a sign
    if bits.shape[0] == full:  # 128 bits: the value counts modulo 2**128 anyway
        return bits
    # a zero entry above keeps the value non-negative, as unsigned
    return torch.cat([bits, bits.new_zeros(1)])
