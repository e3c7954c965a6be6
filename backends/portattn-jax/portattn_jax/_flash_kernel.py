"""The ``jax_flash`` kernel: FlashAttention-2 in ``lax`` loops, with its own backward.

It runs what ``jax_dpa`` leaves (score matrices too large to materialise,
``return_lse``, ``softcap``, float64) in O(L * block) memory, forward and backward,
and compiles to one loop nest whatever the sequence length. Every mask kind runs
through its block form: the loops visit the tiles it lists and mask the partial ones
with ``mask.allows``; a band joined to global tokens runs in three parts instead
(:mod:`._flash_local`). Score changes that follow the distance ``j - i`` (T5's
relative positions, learned ALiBi slopes and their sums) run on the tiles, with their
tables' gradients (:mod:`._flash_scores`); other kinds are refused.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from portattn import dropout
from portattn.kernel import ANY, Kernel
from portattn.masks import KINDS, Function, leaves

from ._pytree import register_mask_pytrees

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs, PagedInputs

__all__ = ["JaxFlashKernel", "flash_plan"]


class JaxFlashKernel(Kernel):
    """Tiled flash attention written with ``jax.lax`` loops and ``jax.custom_vjp``."""

    name = "jax_flash"
    namespaces = frozenset({"jax"})
    devices = ANY
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})
    masks = frozenset(KINDS)
    bias = softcap = gqa = value_head_dim = empty = returns_lse = grad = True
    dropout = dropout_seed = True
    paged = True  # one compiled loop per query-tile size (._paged)
    # the changes by distance, read by the loops at traced tile offsets (_flash_scores)
    score_mod = frozenset({"relative_position", "alibi"})
    deterministic = True
    priority = 60

    #: Longest query/key block, and the score-tile budget over batch and head rows
    #: (256 x 256 tiles of 8 heads ran fastest on CPUs; larger batches shrink block_q).
    max_block: ClassVar[int] = 256
    tile_elements: ClassVar[int] = 1 << 20
    #: Longest block for masks of :data:`FINE_KINDS`.
    fine_block: ClassVar[int] = 128

    @classmethod
    def check_available(cls) -> str | None:
        from importlib.util import find_spec

        return None if find_spec("jax") is not None else "jax is not installed"

    @classmethod
    def not_supported_reasons(cls, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        # The loops are compiled once per mask structure: a function that may read
        # anything would be compiled with what it reads now, and kept.
        if any(isinstance(p, Function) and p.args is None for p in leaves(inputs.mask)):
            reasons.append("a mask function without args= (what it reads must be passed "
                           "as args to be traced, not compiled in)")
        return reasons

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        register_mask_pytrees()
        out, lse = attend(inputs)
        return out, lse if inputs.return_lse else None, None

    @classmethod
    def paged_defers_to(cls, call: PagedInputs) -> tuple[str, ...]:
        # On the CPU, numpy_fast's compiled loop reads JAX's arrays through DLPack and
        # ran a decode step (16 x 4096 keys) in 0.4-0.7x this kernel's time
        # (bench/test_paged.py); it plans the call on the host, so not a traced one
        return ("numpy_fast",) if call.device == "cpu" and not call.traced else ()

    def run_paged(self, call: PagedInputs) -> tuple[Any, Any]:
        register_mask_pytrees()
        if call.traced:  # under jax.jit: the tiles planned on the device
            from ._paged_device import attend_traced

            return attend_traced(call)
        from ._paged import attend_pages

        return attend_pages(call)


def flash_plan(inputs: AttentionInputs) -> Any:
    """The static :class:`FlashPlan` of a call: block sizes from its shapes and mask
    kinds, and whether its batch elements run one at a time (see :func:`per_batch`)."""
    from jax import tree_util

    from ._flash_layout import FlashPlan, block_sizes

    flat = math.prod(inputs.batch_shape)
    kinds = frozenset() if inputs.mask is None else inputs.mask.kinds
    largest = JaxFlashKernel.max_block
    if kinds & FINE_KINDS:
        largest = min(largest, JaxFlashKernel.fine_block)

    def blocks(alone: bool) -> tuple[int, int]:
        rows = inputs.num_heads * (1 if alone else flat)
        return block_sizes(rows, inputs.q_len, inputs.kv_len, largest,
                           JaxFlashKernel.tile_elements)

    alone = per_batch(inputs)
    block_q, block_k = blocks(alone)
    if alone and block_q >= inputs.q_len and block_k >= inputs.kv_len:
        alone = False  # one tile per element leaves nothing to skip: all at once
        block_q, block_k = blocks(alone)
    return FlashPlan(lq=inputs.q_len, lk=inputs.kv_len, block_q=block_q, block_k=block_k,
                     num_heads=inputs.num_heads, num_kv_heads=inputs.num_kv_heads,
                     scale=inputs.scale, softcap=inputs.softcap,
                     batch_shape=tuple(inputs.batch_shape),
                     mask_tree=tree_util.tree_structure(inputs.mask), per_batch=alone,
                     dropout_p=inputs.dropout_p)


FINE_KINDS = frozenset({"documents", "global_tokens", "chunks", "block_layout", "function",
                        "dense"})
"""Kinds whose hidden tiles follow values or single positions: smaller tiles skip more
of them (packed documents of ~500 tokens: 13% of the pairs visited with tiles of 128,
18% with 256), which outweighs their higher cost per pair."""


def per_batch(inputs: AttentionInputs) -> bool:
    """Whether the batch elements should run one at a time, each skipping its own
    tiles: when there are several and the mask holds an array laid out per batch
    element (lengths, ranges, per-row ids or positions, a dense mask over the batch),
    known from the shapes alone (under ``jit`` the values are not)."""
    batch = tuple(inputs.batch_shape)
    if inputs.mask is None or math.prod(batch) <= 1:
        return False
    return any(tuple(a.shape[:len(batch)]) == batch for a in inputs.mask.arrays)


def flat_arguments(inputs: AttentionInputs, plan: Any) -> tuple[Any, ...]:
    """``(q, k, v, bias, mask arrays, tables)`` with the batch dims flattened to one;
    the mask keeps its own arrays (it reads flat batch indices)."""
    import jax.numpy as jnp
    from jax import tree_util

    from ._flash_tables import call_tables

    batch = inputs.batch_shape
    flat = math.prod(batch)

    def lead(x: Any) -> Any:
        return jnp.reshape(x, (flat, *x.shape[len(batch):]))

    tables = call_tables(inputs, plan)
    return (lead(inputs.query), lead(inputs.key), lead(inputs.value),
            _flat_full(inputs.bias, batch), tuple(tree_util.tree_leaves(inputs.mask)), tables)


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

    from ._flash import compute_dtype
    from ._flash_call import flash_attention
    from ._flash_local import band_and_tokens, local_attention
    from ._flash_scores import distance_bias

    lead = (*inputs.batch_shape, inputs.num_heads, inputs.q_len)
    if inputs.q_len == 0 or inputs.kv_len == 0 or not math.prod(inputs.batch_shape):
        out = jnp.zeros((*lead, inputs.value_head_dim), inputs.query.dtype)
        return out, jnp.full(lead, -jnp.inf, compute_dtype(inputs.query.dtype))
    parts = band_and_tokens(inputs)
    if parts is not None:  # a band with global tokens: in three parts (_flash_local)
        return local_attention(inputs, *parts, attend)
    plan = flash_plan(inputs)
    word = dropout.seed_word(inputs) if inputs.dropout_p else None
    distances = distance_bias(inputs, compute_dtype(inputs.query.dtype))
    out, lse = flash_attention(plan, *flat_arguments(inputs, plan), word, distances)
    return jnp.reshape(out, (*lead, inputs.value_head_dim)), jnp.reshape(lse, lead)
