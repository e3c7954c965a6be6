"""transformers' mask-interface arguments as structured portattn masks.

transformers describes a layer's mask as a mask *function* of (batch, head, query,
key) indices plus sizes, offsets and a 2-D padding mask, and asks each attention
implementation to turn them into whatever it consumes. The functions transformers
builds itself are recognised here by identity and by the names of their closures
(causal, sliding-window causal, bidirectional, packed sequences detected from
``position_ids``), so the mask reaches portattn as a band, key ranges and documents,
whose tiles the kernels skip. Anything else (custom ``and``/``or`` overlays, chunked
attention, block ids, traced offsets) falls back to transformers' own boolean mask,
wrapped as ``masks.dense``: always correct, never structured.

Positions: query ``i`` sits at ``q_offset + i`` and key ``j`` at ``kv_offset + j``;
transformers' sliding window of ``w`` counts the query itself (keys ``p - w < j <= p``),
which is portattn's ``sliding_window(w - 1)``.
"""

from __future__ import annotations

import inspect
from typing import Any

from portattn import masks

__all__ = ["NOT_RECOGNISED", "padding_mask", "positional_mask"]

NOT_RECOGNISED = object()
"""A mask function these rules do not know: use transformers' dense mask."""


def _nonlocals(fn: Any) -> dict[str, Any]:
    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except (TypeError, ValueError):
        return {}


def _qualname(fn: Any) -> str:
    return getattr(fn, "__qualname__", "")


def _and_parts(fn: Any) -> tuple[Any, ...] | None:
    """The functions an ``and_masks(...)`` result intersects, None for other functions."""
    if _qualname(fn) != "and_masks.<locals>.and_mask":
        return None
    parts = _nonlocals(fn).get("mask_functions")
    return tuple(parts) if isinstance(parts, tuple) else None


def _window(fn: Any) -> int | None:
    """``w`` of ``sliding_window_overlay(w)``, None for other functions."""
    if _qualname(fn) != "sliding_window_overlay.<locals>.inner_mask":
        return None
    w = _nonlocals(fn).get("sliding_window")
    return w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else None


def positional_mask(mask_function: Any, q_length: int, kv_length: int, q_offset: int,
                    kv_offset: int) -> Any:
    """The structured mask for ``mask_function`` (None: every pair), or
    :data:`NOT_RECOGNISED`."""
    from transformers import masking_utils as mu

    # query i at q_offset + i, key j at kv_offset + j: causal is j - i <= q_offset - kv_offset;
    # portattn's bottom-right masks put query 0 at kv_length - q_length (+ shift)
    shift = (q_offset - kv_offset) - (kv_length - q_length)
    if mask_function is mu.causal_mask_function:
        return masks.Causal("bottom_right", shift=shift)
    if mask_function is mu.bidirectional_mask_function:
        return None
    parts = _and_parts(mask_function)
    if parts is None:
        return NOT_RECOGNISED
    if len(parts) == 2 and parts[1] is mu.causal_mask_function and _window(parts[0]):
        return masks.SlidingWindow(_window(parts[0]) - 1, 0, shift=shift)
    packed = _packed(parts, q_length, kv_length, q_offset, kv_offset)
    return NOT_RECOGNISED if packed is None else packed


def _packed(parts: tuple[Any, ...], q_length: int, kv_length: int, q_offset: int,
            kv_offset: int) -> Any:
    """Packed sequences: ``and_masks(remap_positions(base, position_ids),
    packed_sequence_mask_function(ids))``. transformers detects them only without a
    cache, from position ids that restart at 0 for each document and grow by one, so
    ``base`` on the remapped positions is ``base`` on the raw ones within a document."""
    if len(parts) != 2 or q_length != kv_length or q_offset or kv_offset:
        return None
    remap, same_document = parts
    if (_qualname(remap) != "remap_positions_for_packed_sequence.<locals>.inner_mask"
            or _qualname(same_document) != "packed_sequence_mask_function.<locals>.inner_mask"):
        return None
    ids = _nonlocals(same_document).get("packed_sequence_mask")
    base = positional_mask(_nonlocals(remap).get("mask_function"), q_length, kv_length, 0, 0)
    if ids is None or base is NOT_RECOGNISED:
        return None
    documents = masks.documents(ids)
    return documents if base is None else base & documents


def padding_mask(attention_mask: Any, kv_length: int, kv_offset: int) -> Any:
    """The 2-D padding mask ``(batch, >= kv_offset + kv_length)`` (True = real token)
    of this layer's keys, as ``key_ranges`` when every row keeps one contiguous run
    (left or right padding), else as a ``dense`` ``(batch, 1, 1, Lk)`` mask; None when
    nothing is padding."""
    import torch

    if attention_mask is None:
        return None
    keep = attention_mask[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    if keep.shape[-1] < kv_length:  # positions past the mask (a static cache's tail)
        keep = torch.nn.functional.pad(keep, (0, kv_length - keep.shape[-1]))
    if torch.compiler.is_compiling():
        return masks.dense(keep[:, None, None, :])
    if bool(keep.all()):
        return None
    count = keep.sum(dim=-1)
    index = torch.arange(kv_length, device=keep.device)
    # the first kept key of each row (kv_length when none), and one past its last
    start = torch.where(keep, index, kv_length).amin(dim=-1)
    stop = torch.where(keep, index + 1, 0).amax(dim=-1)
    start = torch.where(count > 0, start, 0)
    if bool((stop - start == count).all()):
        return masks.key_ranges(start, stop)
    return masks.dense(keep[:, None, None, :])
