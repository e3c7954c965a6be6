"""The rule for non-finite inputs, for kernels that cannot keep it inside their loops.

The rule (docs/semantics.md): masked positions never reach the result,
and a row that attends a non-finite key or value (one its mask lets it see) is NaN. A
library kernel such as SDPA gives a hidden key weight 0, but ``0 * NaN`` is NaN, so a
hidden NaN there reaches the row. A kernel keeps the rule around such a call, with no
value read on the host (nothing to sync, fine under tracing)::

    key, value, bad = clear_keys(xp, inputs.key, inputs.value)
    out = library_attention(query, key, value, ...)          # every input finite now
    out = poison(xp, out, rows_seeing(inputs, bad))

- :func:`clear_keys` sets every key row whose key or value holds a NaN or inf to 0 in
  both, and says which rows those were;
- :func:`rows_seeing` finds the query rows the call's mask lets see such a key, from
  its block form (hidden tiles cost nothing, full ones a sum, partial ones the tile's
  mask times a column), never as an ``Lq x Lk`` array;
- :func:`poison` multiplies those rows by NaN: their output is NaN as the rule says,
  and so are their gradients, as the chain rule through a NaN makes them.

It costs a pass over the keys and values and a copy of them, O((Lq + Lk) * D) next to
the attention's O(Lq * Lk * D). Written against the Array API: any library.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .kernel import AttentionInputs

__all__ = ["clear_keys", "poison", "rows_seeing"]

#: Query and key block lengths of :func:`rows_seeing`'s pass.
BLOCK = 256


def clear_keys(xp: Any, key: Any, value: Any) -> tuple[Any, Any, Any]:
    """Set every key row that holds a NaN or inf (in the key or its value) to 0 in
    both arrays.

    Args:
        xp: the array namespace of ``key`` and ``value``.
        key: ``(..., Hkv, Lk, D)``.
        value: ``(..., Hkv, Lk, Dv)``.

    Returns:
        ``(key, value, bad)``: the cleared copies, and ``bad`` ``(..., Hkv, Lk)``,
        True on the rows that were cleared.

    Example:
        >>> import numpy as np
        >>> from array_api_compat import array_namespace
        >>> from portattn.nonfinite import clear_keys
        >>> key = np.ones((1, 1, 3, 2))
        >>> value = np.ones((1, 1, 3, 2))
        >>> value[0, 0, 1, 0] = np.inf
        >>> key, value, bad = clear_keys(array_namespace(key), key, value)
        >>> bad.tolist()
        [[[False, True, False]]]
        >>> value[0, 0].tolist()
        [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    """
    bad = xp.logical_not(xp.logical_and(xp.all(xp.isfinite(key), axis=-1),
                                         xp.all(xp.isfinite(value), axis=-1)))
    column = bad[..., None]
    return (xp.where(column, xp.zeros_like(key), key),
            xp.where(column, xp.zeros_like(value), value), bad)


def rows_seeing(inputs: AttentionInputs, bad: Any) -> Any:
    """The query rows that ``inputs.mask`` lets attend a key ``bad`` marks.

    Read from the mask's block form: never an ``Lq x Lk`` array, and nothing read on
    the host.

    Args:
        inputs: the call's :class:`~portattn.kernel.AttentionInputs`.
        bad: boolean ``(..., Hkv, Lk)``, as :func:`clear_keys` gives it.

    Returns:
        Boolean ``(..., Hq, Lq)``.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> from portattn.nonfinite import rows_seeing
        >>> q = np.zeros((1, 1, 4, 2))
        >>> inputs = portattn.explain(q, q, q, mask=masks.causal()).inputs
        >>> bad = np.array([[[False, False, True, False]]])
        >>> rows_seeing(inputs, bad).tolist()
        [[[False, False, True, True]]]
    """
    xp = inputs.xp
    group = inputs.group_size
    dtype = inputs.compute_dtype
    # one column per query head: (..., Hq, Lk, 1), counted in floats by products
    column = xp.astype(bad, dtype)
    if group > 1:
        *lead, hkv, lk = column.shape
        column = xp.reshape(xp.broadcast_to(column[..., None, :], (*lead, hkv, group, lk)),
                            (*lead, hkv * group, lk))
    column = column[..., None]
    lead = (*inputs.batch_shape, inputs.num_heads)
    if inputs.mask is None:
        seen = xp.sum(column, axis=(-2, -1)) > 0
        return xp.broadcast_to(seen[..., None], (*lead, inputs.q_len))
    blocks = inputs.blocks(BLOCK, BLOCK)
    rows = []
    for a in range(blocks.num_q_blocks):
        q0, q1 = blocks.q_range(a)
        count = xp.zeros((*lead, q1 - q0, 1), dtype=dtype, device=inputs.device_obj)
        for b, full in blocks.kv_blocks(a):
            k0, k1 = blocks.kv_range(b)
            keys = column[..., k0:k1, :]
            if full:
                count = count + xp.sum(keys, axis=-2, keepdims=True)
            else:
                tile = inputs.mask.tile(xp, q0, q1, k0, k1, inputs.q_len, inputs.kv_len,
                                        inputs.device_obj)
                count = count + xp.matmul(xp.astype(tile, dtype), keys)
        rows.append(count[..., 0] > 0)  # a sum of zeros and ones: 0 only when all are
    if not rows:
        return xp.zeros((*lead, 0), dtype=xp.bool, device=inputs.device_obj)
    return xp.concat(rows, axis=-1) if len(rows) > 1 else rows[0]


def poison(xp: Any, out: Any, rows: Any) -> Any:
    """Multiply the chosen rows of an output by NaN.

    Args:
        xp: the array namespace of ``out``.
        out: ``(..., Hq, Lq, Dv)``.
        rows: boolean ``(..., Hq, Lq)``, or any shape that broadcasts to it.

    Returns:
        ``out`` with those rows NaN (the others unchanged).

    Example:
        >>> import numpy as np
        >>> from array_api_compat import array_namespace
        >>> from portattn.nonfinite import poison
        >>> out = np.ones((1, 1, 3, 2))
        >>> rows = np.array([[[False, True, False]]])
        >>> np.isnan(poison(array_namespace(out), out, rows))[0, 0, :, 0].tolist()
        [False, True, False]
    """
    if math.prod(out.shape) == 0:
        return out
    nan = xp.full((), math.nan, dtype=out.dtype, device=_device(xp, out))
    one = xp.ones((), dtype=out.dtype, device=_device(xp, out))
    return out * xp.where(rows, nan, one)[..., None]


def _device(xp: Any, a: Any) -> Any:
    from array_api_compat import device

    try:
        return device(a)
    except Exception:  # a tracer while JAX traces: no device to name
        return None
