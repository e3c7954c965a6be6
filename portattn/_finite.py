"""The output check for kernels that are exact only on finite inputs.

The README's rule for non-finite inputs (masked positions never reach the result; a
row that attends a non-finite value, has a NaN query or overflowing scores is NaN)
costs a fused kernel work on every call, so a kernel may declare
``finite_inputs_only`` instead. Such kernels break the rule in three ways: a hidden
NaN or inf reaches the weights-times-values product as ``0 * NaN`` (the output holds
NaN or inf); a row whose scores are NaN or overflow comes out as zeros (torch's CPU
kernel, Triton); a backward pass meets hidden inputs in its products (``dS @ K``).
So dispatch reads each row's magnitude from the output (one small pass) and, only
when a row is exactly zero or gradients will flow, the extremes of the inputs. A call
that fails runs on a kernel that follows the rule. On accelerators, under tracing
(``jax.jit``, ``torch.compile``) and on lazy Dask arrays nothing is checked."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._inputs import dtype_name
from ._mask_values import values_readable

if TYPE_CHECKING:
    from ._inputs import AttentionInputs

__all__ = ["distrust"]


def distrust(inputs: AttentionInputs, out: Any) -> str | None:
    """Why ``out``, from a kernel exact only on finite inputs, may break the rule for
    non-finite inputs; None when it cannot (or the values cannot be read)."""
    # On an accelerator every read would stall the caller's stream (a host sync per
    # call, which decode loops cannot afford): the check is made on the host only.
    if inputs.device != "cpu" or math.prod(out.shape) == 0 or not values_readable(out):
        return None
    xp, wide = inputs.xp, inputs.compute_dtype
    rows = xp.sum(xp.abs(_plain(out)), axis=-1, dtype=wide)  # NaN, inf and zero rows stay so
    if not math.isfinite(float(xp.sum(rows))):
        return "its output holds NaN or inf (a hidden non-finite value, or 0 * inf)"
    # A row of zeros is an answer (a fully masked row, zero values) or a NaN/overflow;
    # and a backward pass meets even the hidden inputs in its products (dS @ K, ...).
    zero_rows = float(xp.min(rows)) == 0 and inputs.kv_len > 0
    if not (zero_rows or inputs.requires_grad):
        return None
    named = [("query", inputs.query), ("key", inputs.key)]
    if inputs.requires_grad:
        named.append(("value", inputs.value))
    extremes = {}
    for name, a in named:
        low, high = extremes[name] = _extremes(xp, _plain(a))
        if not (math.isfinite(low) and math.isfinite(high)):
            return f"{name} holds NaN or inf ({name} min={low}, max={high})"
    (q_low, q_high), (k_low, k_high) = extremes["query"], extremes["key"]
    bound = abs(inputs.scale) * inputs.head_dim * max(-q_low, q_high) * max(-k_low, k_high)
    if bound > float(xp.finfo(wide).max) / 2:
        return (f"scores may overflow {dtype_name(wide)}: |scale| * head_dim * "
                f"max|query| * max|key| = {bound:.3g}")
    return None


def _extremes(xp: Any, a: Any) -> tuple[float, float]:
    """``(min, max)`` of ``a`` as Python floats (both NaN when ``a`` holds a NaN)."""
    return float(xp.min(a)), float(xp.max(a))


def _plain(a: Any) -> Any:
    """``a`` without its autograd record (arrays that keep one have ``detach``): what is
    read here is no part of the result."""
    detach = getattr(a, "detach", None)
    return detach() if callable(detach) else a
