"""Combining attention computed over disjoint key blocks (split-KV, ring attention)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace

from ._inputs import dtype_name

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["merge"]


def merge(outputs: Sequence[Any], lses: Sequence[Any]) -> tuple[Any, Any]:
    """Exact attention over the union of disjoint key blocks.

    ``outputs[i]`` ``(..., Hq, Lq, Dv)`` and ``lses[i]`` ``(..., Hq, Lq)`` are the results
    of attention over key block ``i``. With ``w_i = exp(lse_i - lse)`` and
    ``lse = log(sum_i exp(lse_i))``, the merged output is ``sum_i w_i * out_i``. Rows
    masked in every block stay 0 with lse ``-inf``.
    """
    outputs, lses = list(outputs), list(lses)
    if not outputs or len(outputs) != len(lses):
        msg = (f"merge needs one lse per output and at least one of each; got "
               f"{len(outputs)} outputs and {len(lses)} lses")
        raise ValueError(msg)
    xp = array_namespace(*outputs, *lses)
    for i, (out, lse) in enumerate(zip(outputs, lses, strict=True)):
        if tuple(out.shape[:-1]) != tuple(lse.shape) or out.shape != outputs[0].shape:
            msg = (f"outputs[{i}].shape={tuple(out.shape)} and lses[{i}].shape="
                   f"{tuple(lse.shape)} do not match (..., Hq, Lq, Dv) and (..., Hq, Lq), "
                   f"or differ from outputs[0].shape={tuple(outputs[0].shape)}")
            raise ValueError(msg)
    out_dtype = outputs[0].dtype
    ct = xp.float32 if dtype_name(out_dtype) in ("float16", "bfloat16") else out_dtype
    stacked = xp.stack([xp.astype(lse, ct) for lse in lses], axis=0)
    top = xp.max(stacked, axis=0)
    top = xp.where(top == -math.inf, xp.zeros_like(top), top)
    weights = xp.exp(stacked - top)
    total = xp.sum(weights, axis=0)
    has_mass = total > 0
    safe = xp.where(has_mass, total, xp.ones_like(total))
    acc = None
    for i, out in enumerate(outputs):
        term = xp.astype(out, ct) * weights[i, ..., None]
        acc = term if acc is None else acc + term
    merged = xp.astype(acc / safe[..., None], out_dtype)
    lse = xp.where(has_mass, top + xp.log(safe), xp.full_like(total, -math.inf))
    return merged, lse
