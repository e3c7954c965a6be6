"""Dispatch decisions remembered per call signature.

Training loops and decoders call attention with the same shapes, dtypes, devices and
options again and again. What :func:`describe` checks and :func:`choose` decides
follows from those alone (the Kernel protocol: refusals never read values or memory
layout), so both are remembered per signature and reused with the new arrays. A
repeated call then costs one dictionary lookup instead of validation and a walk over
the kernels.

Only calls that are fully described by hashable values are remembered: no arrays in
the mask, no bias, Python numbers for the options, and arrays whose type carries a
standard ``.device`` (not Dask, whose device hides in its chunks; a traced JAX array
raises on ``.device`` and is never remembered, so no tracer is kept alive).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._dispatch import choose, current_overrides
from ._inputs import AttentionInputs, describe, needs_grad
from ._registry import kernel_entries
from .masks import Mask

if TYPE_CHECKING:
    from ._registry import KernelEntry

__all__ = ["described_and_chosen"]

MAX_SIGNATURES = 256
"""Beyond this many signatures (shapes that change every call) start again."""

_calls: dict[tuple, tuple[list[KernelEntry], tuple, KernelEntry]] = {}
_traits: dict[type, tuple[bool, bool]] = {}
"""Per array type: has a standard ``.device``; has torch's ``.requires_grad``."""
_NUMBERS = (int, float, type(None))


def described_and_chosen(query: Any, key: Any, value: Any, mask: Mask | None, bias: Any,
                         scale: Any, softcap: Any, return_lse: Any, return_weights: Any,
                         dropout_p: Any, kernel: str | None,
                         ) -> tuple[AttentionInputs, KernelEntry]:
    """``describe(...)`` and ``choose(...)`` of one call, remembered per signature."""
    entries = kernel_entries()
    signature = _signature(query, key, value, mask, bias, scale, softcap, return_lse,
                           return_weights, dropout_p, kernel)
    if signature is not None:
        try:
            remembered = _calls.get(signature)
        except (TypeError, AttributeError):
            # Symbolic shapes or a mask still being built while a compiler traces
            # (torch.compile), unhashable options: not remembered.
            remembered = signature = None
        # A refreshed registry is a new list: what was chosen from the old one is stale.
        if remembered is not None and remembered[0] is entries:
            _, rest, entry = remembered
            return AttentionInputs._make((query, key, value, *rest)), entry
    inputs = describe(query, key, value, mask=mask, bias=bias, scale=scale,
                      softcap=softcap, return_lse=return_lse,
                      return_weights=return_weights, dropout_p=dropout_p)
    entry = choose(inputs, kernel)
    if signature is not None:
        if len(_calls) >= MAX_SIGNATURES:
            _calls.clear()
        _calls[signature] = (entries, tuple(inputs)[3:], entry)  # no arrays kept alive
    return inputs, entry


def _signature(query: Any, key: Any, value: Any, mask: Any, bias: Any, scale: Any,
               softcap: Any, return_lse: Any, return_weights: Any, dropout_p: Any,
               kernel: str | None) -> tuple | None:
    """Everything describe() and choose() read, or None when the call is not cacheable."""
    kind = type(query)
    if (bias is not None or type(key) is not kind or type(value) is not kind
            or type(scale) not in _NUMBERS or type(softcap) not in _NUMBERS
            or type(dropout_p) not in _NUMBERS
            # 1 == True as a key: a remembered True call must not accept return_lse=1
            or type(return_lse) is not bool or type(return_weights) is not bool
            or (mask is not None and (not isinstance(mask, Mask) or mask.arrays))):
        return None
    traits = _traits.get(kind)
    if traits is None:
        traits = _traits[kind] = (hasattr(kind, "device"), hasattr(kind, "requires_grad"))
    has_device, tracks_grad = traits
    if not has_device:
        return None
    try:
        devices = (query.device, key.device, value.device)
    except Exception:  # a traced array has no device
        return None
    # Without .requires_grad, whether gradients flow follows from the type alone.
    grad = tracks_grad and (query.requires_grad or key.requires_grad or value.requires_grad
                            ) and needs_grad((query, key, value))
    # The mask by its key, not the object: under torch.compile a mask built inside the
    # traced function does not exist yet as an object to hash.
    mask_key = None if mask is None else mask.key()
    return (kind, query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
            *devices, mask_key, scale, softcap, return_lse, return_weights, dropout_p, grad,
            kernel, *current_overrides())
