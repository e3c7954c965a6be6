"""The ``jax_flash`` kernel: FlashAttention-2 in ``lax`` loops, with its own backward.

It runs what ``jax_dpa`` leaves (score matrices too large to materialise,
``return_lse``, ``softcap``, float64) in O(L * block) memory, forward and backward,
and compiles to one loop nest whatever the sequence length.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from portattn.kernel import ANY, Kernel

from ._pytree import register_mask_pytrees
from ._translate import fold_mask

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["JaxFlashKernel", "flash_plan"]


class JaxFlashKernel(Kernel):
    """Tiled flash attention written with ``jax.lax`` loops and ``jax.custom_vjp``."""

    name = "jax_flash"
    namespaces = frozenset({"jax"})
    devices = ANY
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})
    # key_ranges: its boolean mask (B, 1, 1, Lk) stays O(L); the other array kinds would
    # need a full (Lq, Lk) array here, so they are left to jax_dpa and tiled.
    masks = frozenset({"causal", "sliding_window", "key_lengths", "query_lengths", "dense",
                       "key_ranges"})
    bias = softcap = gqa = value_head_dim = empty = returns_lse = grad = True
    deterministic = True
    priority = 60

    #: Longest query/key block, and the score-tile budget over batch and head rows
    #: (256 x 256 tiles of 8 heads ran fastest on CPUs; larger batches shrink block_q).
    max_block: ClassVar[int] = 256
    tile_elements: ClassVar[int] = 1 << 20

    @classmethod
    def check_available(cls) -> str | None:
        from importlib.util import find_spec

        return None if find_spec("jax") is not None else "jax is not installed"

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        register_mask_pytrees()
        out, lse = attend(inputs)
        return out, lse if inputs.return_lse else None, None


def flash_plan(inputs: AttentionInputs) -> Any:
    """The static :class:`FlashPlan` of a call (block sizes from its shapes)."""
    from ._flash_layout import FlashPlan, block_sizes

    spec = fold_mask(inputs)
    rows = math.prod(inputs.batch_shape) * inputs.num_heads
    block_q, block_k = block_sizes(rows, inputs.q_len, inputs.kv_len,
                                   JaxFlashKernel.max_block, JaxFlashKernel.tile_elements)
    return FlashPlan(lq=inputs.q_len, lk=inputs.kv_len, block_q=block_q, block_k=block_k,
                     num_kv_heads=inputs.num_kv_heads, scale=inputs.scale,
                     softcap=inputs.softcap, band=spec.band)


def flat_arguments(inputs: AttentionInputs) -> tuple[Any, ...]:
    """``(q, k, v, bias, kl, ql, dense)`` with the batch dims flattened to one, the
    lengths and dense parts of the mask each combined into one array (or None)."""
    import jax.numpy as jnp

    from ._compute import _combined as combined

    spec = fold_mask(inputs)
    batch = inputs.batch_shape
    flat = math.prod(batch)

    def lead(x: Any) -> Any:
        return jnp.reshape(x, (flat, *x.shape[len(batch):]))

    kl = combined(jnp.minimum, spec.key_lengths)
    ql = combined(jnp.minimum, spec.query_lengths)
    dense = combined(jnp.logical_and, spec.dense_arrays(inputs.q_len, inputs.kv_len))
    return (lead(inputs.query), lead(inputs.key), lead(inputs.value),
            _flat_full(inputs.bias, batch), None if kl is None else jnp.reshape(kl, (flat,)),
            None if ql is None else jnp.reshape(ql, (flat,)), _flat_full(dense, batch))


def _flat_full(x: Any, batch: tuple[int, ...]) -> Any:
    """A full-rank ``(*batch|1, H|1, Lq|1, Lk|1)`` array as ``(B|1, H|1, Lq|1, Lk|1)``."""
    import jax.numpy as jnp

    if x is None:
        return None
    lead, rest = x.shape[:len(batch)], x.shape[len(batch):]
    if all(s == 1 for s in lead):
        return jnp.reshape(x, (1, *rest))
    if lead != batch:  # broadcast over some batch dims only
        x = jnp.broadcast_to(x, (*batch, *rest))
    return jnp.reshape(x, (math.prod(batch), *rest))


def attend(inputs: AttentionInputs) -> tuple[Any, Any]:
    """``(out, lse)`` of one call, differentiable with the flash backward."""
    import jax.numpy as jnp

    from ._flash import compute_dtype, flash_attention

    lead = (*inputs.batch_shape, inputs.num_heads, inputs.q_len)
    if inputs.q_len == 0 or inputs.kv_len == 0 or not math.prod(inputs.batch_shape):
        out = jnp.zeros((*lead, inputs.value_head_dim), inputs.query.dtype)
        return out, jnp.full(lead, -jnp.inf, compute_dtype(inputs.query.dtype))
    out, lse = flash_attention(flash_plan(inputs), *flat_arguments(inputs))
    return jnp.reshape(out, (*lead, inputs.value_head_dim)), jnp.reshape(lse, lead)
