"""Score changes on ``jax_flash``: those that are a function of the distance ``j - i``
alone (T5's relative positions, learned ALiBi slopes and their sums) run natively, as
a bias by distance on the tiles (:mod:`._flash_distance`).

The change's :meth:`~portattn.scores.ScoreChange.by_distance` array, ``(Hq, Lq + Lk -
1)``, is made once per call and goes into the loops as one more differentiable
argument; its gradient, summed tile by tile, reaches the tables through the change's
own :meth:`~portattn.scores.ScoreChange.distance_gradients` (products with one-hot
matrices), not through JAX's transpose of the gather (a scatter-add, whose order a GPU
does not fix). Other kinds (pair tables, Swin's window table) have entries that do not
follow the distance, which the loops could only read at static tile offsets: the kernel
does not declare them (``score_mod``), so they run on ``tiled``.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["distance_bias"]


def distance_bias(inputs: AttentionInputs, dtype: Any) -> Any:
    """``(Hq, Lq + Lk - 1)`` in ``dtype``: the call's score change by distance,
    differentiable in its tables (None without a change)."""
    change = inputs.score_mod
    if change is None:
        return None
    arrays = tuple(change.arrays)
    static = (change.with_arrays((None,) * len(arrays)), inputs.q_len, inputs.kv_len, dtype)
    return _wired()(static, arrays)


def _computed(static: tuple[Any, ...], arrays: tuple[Any, ...]) -> Any:
    import jax.numpy as jnp

    change, q_len, kv_len, dtype = static
    return change.with_arrays(arrays).by_distance(jnp, q_len, kv_len).astype(dtype)


_cache: list[Any] = []


def _wired() -> Any:
    """The ``custom_vjp`` function, built once (JAX is imported by the first call)."""
    if _cache:
        return _cache[0]
    import jax
    import jax.numpy as jnp

    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def by_distance(static, arrays):
        return _computed(static, arrays)

    def fwd(static, arrays):
        return _computed(static, arrays), arrays

    def bwd(static, arrays, g):
        change, q_len, kv_len, dtype = static
        grads = change.with_arrays(arrays).distance_gradients(jnp, g, q_len, kv_len, dtype)
        # the change's indices (if any) are constants
        return (tuple(None if d is None or not t else d.astype(a.dtype) for d, a, t in zip(
            grads, arrays, change.trainable, strict=True)),)

    by_distance.defvjp(fwd, bwd)
    _cache.append(by_distance)
    return by_distance
