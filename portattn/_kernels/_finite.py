"""The output check for kernels that are exact only on finite inputs.

The rule for non-finite inputs (docs/semantics.md) (masked positions never reach the result; a
row that attends a non-finite value is NaN) costs a fused kernel work on every call,
so a kernel may declare ``finite_inputs_only`` instead. A hidden NaN or inf then
reaches its weights-times-values product as ``0 * NaN``, so its output holds NaN or
inf where it should not; and a backward pass meets hidden inputs in its products
(``dS @ K``). For calls whose mask or bias can hide anything, dispatch therefore sums
the output (one pass over it, a few microseconds) and, when gradients will flow,
reads the extremes of the inputs; a call that fails runs on a kernel that follows
the rule. On accelerators (a host sync per call), under tracing (``jax.jit``,
``torch.compile``) and on lazy Dask arrays nothing is checked
(``AttentionInputs.values_readable`` is False): there such a kernel keeps the rule
itself or not at all (torch's SDPA kernel does, on the device).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._inputs import AttentionInputs

__all__ = ["distrust"]


def distrust(inputs: AttentionInputs, out: Any) -> str | None:
    """Why ``out``, from a kernel exact only on finite inputs, may break the rule for
    non-finite inputs; None when it cannot (or the values cannot be read)."""
    if inputs.assume_finite or (inputs.mask is None and inputs.bias is None):
        return None  # nothing is hidden: a NaN that reaches the output belongs there
    if not inputs.values_readable or math.prod(out.shape) == 0:
        return None
    lq, lk = inputs.q_len, inputs.kv_len
    if inputs.bias is None and inputs.mask.covers(0, lq, 0, lk, lq, lk):
        return None  # a mask that allows every pair (a causal decode step) hides nothing
    xp = inputs.xp
    if not math.isfinite(float(xp.sum(_plain(out), dtype=inputs.compute_dtype))):
        return "its output holds NaN or inf (a hidden non-finite value, or 0 * inf)"
    if not inputs.requires_grad:
        return None
    for name, a in (("query", inputs.query), ("key", inputs.key), ("value", inputs.value)):
        low, high = _extremes(xp, _plain(a))
        if not (math.isfinite(low) and math.isfinite(high)):
            return (f"{name} holds NaN or inf ({name} min={low}, max={high}), which the "
                    "backward pass would meet where the mask hides it")
    return None


def _extremes(xp: Any, a: Any) -> tuple[float, float]:
    """``(min, max)`` of ``a`` as Python floats (both NaN when ``a`` holds a NaN)."""
    return float(xp.min(a)), float(xp.max(a))


def _plain(a: Any) -> Any:
    """``a`` without its autograd record (arrays that keep one have ``detach``): what is
    read here is no part of the result."""
    detach = getattr(a, "detach", None)
    return detach() if callable(detach) else a
