"""Dropout seeds for torch (entry point ``portattn.seeds:torch``): a call given no
``dropout_seed`` draws one from torch's generator for the tensors' device, so
``torch.manual_seed`` makes it repeatable, as for torch's own dropout."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["draw"]


def draw(like: Any) -> Any:
    """Two int32 words drawn on ``like``'s device (no host sync on an accelerator)."""
    return torch.randint(-(1 << 31), (1 << 31) - 1, (2,), dtype=torch.int32,
                         device=like.device)
