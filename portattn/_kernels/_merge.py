"""Combining attention computed over disjoint key blocks (split-KV, ring attention)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace

from .._lib import dtype_name
from ._portable import with_empty_rows

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["merge"]


def merge(outputs: Sequence[Any], lses: Sequence[Any]) -> tuple[Any, Any]:
    """Exact attention over the union of disjoint key blocks.

    ``outputs[i]`` ``(..., Hq, Lq, Dv)`` and ``lses[i]`` ``(..., Hq, Lq)`` are the results
    of attention over key block ``i``. With ``w_i = exp(lse_i - lse)`` and
    ``lse = log(sum_i exp(lse_i))``, the merged output is ``sum_i w_i * out_i``. Rows
    masked in every block stay 0 with lse ``-inf``.

    Args:
        outputs: The outputs ``(..., Hq, Lq, Dv)`` of attention over each key block.
        lses: Their log-sum-exps ``(..., Hq, Lq)``, one per output.

    Returns:
        ``(out, lse)`` of attention over all the blocks together.

    Raises:
        ValueError: No outputs, a different number of lses, or shapes that differ.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> rng = np.random.default_rng(0)
        >>> q, k, v = (rng.standard_normal((1, 2, 8, 4), dtype=np.float32) for _ in range(3))
        >>> halves = [portattn.attention(q, k[..., s, :], v[..., s, :], return_lse=True)
        ...           for s in (slice(0, 4), slice(4, 8))]
        >>> out, lse = portattn.merge(*zip(*halves))
        >>> full, full_lse = portattn.attention(q, k, v, return_lse=True)
        >>> bool(np.allclose(out, full, atol=1e-6)), bool(np.allclose(lse, full_lse, atol=1e-6))
        (True, True)
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
    top = xp.where(xp.isinf(top) & (top < 0), xp.zeros_like(top), top)  # no inf constant
    weights = xp.exp(stacked - top)
    total = xp.sum(weights, axis=0)
    has_mass = total > 0
    safe = xp.where(has_mass, total, xp.ones_like(total))
    acc = None
    for i, out in enumerate(outputs):
        term = xp.astype(out, ct) * weights[i, ..., None]
        acc = term if acc is None else acc + term
    merged = xp.astype(acc / safe[..., None], out_dtype)
    lse = with_empty_rows(xp, top + xp.log(safe), has_mass)
    return merged, lse
