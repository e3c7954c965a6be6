"""Dispatch decisions remembered per call signature.

Training loops and decoders call attention with the same shapes, dtypes, devices and
options again and again. What :func:`describe` checks and :func:`select` decides
follows from those alone (the Kernel protocol: refusals never read values or memory
layout), so both are remembered per signature and reused with the new arrays. A
repeated call then costs one dictionary lookup instead of validation and a walk over
the kernels.

The signature is built from the call's arguments generically (every option by name, type
and value), so a new option is remembered correctly without being listed here. Only
calls that are fully described by hashable values are remembered: no arrays in the mask
or the options, no mask function that may read anything, and arrays whose type carries a
standard ``.device`` (not Dask, whose device hides in its chunks; a traced JAX array
raises on ``.device`` and is never remembered, so no tracer is kept alive).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._inputs import AttentionInputs, describe
from .._lib import needs_grad
from ..masks import Mask
from ._registry import kernel_entries
from ._select import choose, compiling, current_overrides
from ._tune import table_in_use

if TYPE_CHECKING:
    from ._registry import KernelEntry

__all__ = ["described_and_chosen"]

MAX_SIGNATURES = 256
"""Beyond this many signatures (shapes that change every call) start again."""

_calls: dict[tuple, tuple[tuple[list[KernelEntry], Any], tuple, KernelEntry]] = {}
_traits: dict[type, tuple[bool, bool]] = {}
"""Per array type: has a standard ``.device``; has torch's ``.requires_grad``."""
_PLAIN = (int, float, bool, str, type(None))
"""Option values a signature may hold as they are."""


def described_and_chosen(query: Any, key: Any, value: Any, options: dict[str, Any],
                         kernel: str | None) -> tuple[AttentionInputs, KernelEntry]:
    """``describe(query, key, value, **options)`` and ``choose(...)`` of one call,
    remembered per signature."""
    # What dispatch reads besides the call: a refreshed registry is a new list, a new
    # tune file a new table, and what was chosen with the old ones is stale. (A tracing
    # compiler reads no files: select() then ignores the tune file too.)
    traced = compiling()
    context = (kernel_entries(), None if traced else table_in_use())
    # While torch.compile traces, a lookup would compare the call's key with keys of
    # other libraries' calls (NumPy dtypes), which dynamo cannot; tracing runs once.
    signature = None if traced else _signature(query, key, value, options, kernel)
    if signature is not None:
        try:
            remembered = _calls.get(signature)
        except (TypeError, AttributeError):
            # Symbolic shapes or a mask still being built while a compiler traces
            # (torch.compile), unhashable options: not remembered.
            remembered = signature = None
        if (remembered is not None and remembered[0][0] is context[0]
                and remembered[0][1] is context[1]):
            _, rest, entry = remembered
            return AttentionInputs._make((query, key, value, *rest)), entry
    inputs = describe(query, key, value, **options)
    entry = choose(inputs, kernel)
    if signature is not None:
        if len(_calls) >= MAX_SIGNATURES:
            _calls.clear()
        _calls[signature] = (context, tuple(inputs)[3:], entry)  # no arrays kept alive
    return inputs, entry


def _signature(query: Any, key: Any, value: Any, options: dict[str, Any],
               kernel: str | None) -> tuple | None:
    """Everything describe() and select() read, or None when the call is not cacheable."""
    kind = type(query)
    if type(key) is not kind or type(value) is not kind:
        return None
    described = []
    for name, option in options.items():
        if isinstance(option, Mask):
            # Lengths and dense masks are validated by value and copied at each call;
            # a mask function's block form is built anew unless it says what it reads.
            if option.arrays:
                return None
            # By its content key, not the object: under torch.compile a mask built
            # inside the traced function does not exist yet as an object to hash.
            option = option.content_key()
            if option is None:
                return None
        elif type(option) not in _PLAIN:  # arrays (bias, a boolean mask), numpy scalars
            return None
        # the type too: 1 == True, and a remembered True must not accept return_lse=1
        described.append((name, type(option), option))
    traits = _traits.get(kind)
    if traits is None:
        traits = _traits[kind] = (hasattr(kind, "device"), hasattr(kind, "requires_grad"))
    has_device, tracks_grad = traits
    if not has_device:
        return None
    try:
        devices = tuple(map(_hashable, (query.device, key.device, value.device)))
    except Exception:  # a traced array has no device
        return None
    # Without .requires_grad, whether gradients flow follows from the type alone.
    grad = tracks_grad and (query.requires_grad or key.requires_grad or value.requires_grad
                            ) and needs_grad((query, key, value))
    return (kind, query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
            *devices, *described, grad, kernel, *current_overrides())


def _hashable(device: Any) -> Any:
    """``device``, or its type and name when it has no hash (CuPy's ``Device``)."""
    try:
        hash(device)
    except TypeError:
        return (type(device), str(device))
    return device
