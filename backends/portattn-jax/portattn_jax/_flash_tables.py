"""The block form of a call as the index tables the ``jax_flash`` loops read.

For each query block, the key blocks to visit with the mask (partial tiles) and
without it (full tiles), with their counts: the loops' traced trip counts. For each
key block, the transposed lists (the backward's dK/dV pass). They are arrays passed
to the compiled loops, never constants in them, so new lengths or document ids reuse
the compiled program.

Where the mask's values can be read (eager calls) the tables come from the core's
block form, built once per mask and grid on the host. Under a trace (``jax.jit``,
``vmap``: a mask passed as an argument or built inside the traced function) they come
from block states the masks compute in the compiled program from their traced arrays
(``Mask.device_states``), so packed documents and lengths still skip tiles there;
dense masks, layouts and mask functions are evaluated pair by pair, a query block at a
time (what reading a dense mask costs anyway).

The heads of a batch element share one table (merged states: a tile is hidden only
where it is hidden for all of them): the loops compute all heads of a tile at once.
The batch elements share one too, or with ``per_batch`` each has its own (a leading
batch axis on every table) and runs its own loops.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from portattn import masks
from portattn.kernel import values_readable

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

    from ._flash_layout import FlashPlan

__all__ = ["Tables", "call_tables", "device_states", "device_tables", "host_tables",
           "per_element"]


class Tables(NamedTuple):
    """FlexAttention's index tables (int32) of the merged states: row ``a`` of
    ``kv_indices[a, :kv_num[a]]`` lists the partial key blocks of query block ``a`` in
    order, ``full_kv_*`` its full ones; the ``q_*`` tables are the transpose."""

    kv_num: Any
    kv_indices: Any
    full_kv_num: Any
    full_kv_indices: Any
    q_num: Any
    q_indices: Any
    full_q_num: Any
    full_q_indices: Any


_host_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def host_tables(blocks: masks.BlockMask, batch_shape: tuple[int, ...] | None = None) -> Tables:
    """The tables of a host block form (NumPy), remembered per block form; with a
    ``batch_shape``, one per flat batch element."""
    cache = _host_cache.setdefault(blocks, {})
    found = cache.get(batch_shape)
    if found is None:
        states = blocks.merged if batch_shape is None else per_element(blocks.states,
                                                                      batch_shape)
        t = replace(blocks, states=states).tables()
        found = cache[batch_shape] = Tables(
            t.kv_num_blocks, t.kv_indices, t.full_kv_num_blocks, t.full_kv_indices,
            t.q_num_blocks, t.q_indices, t.full_q_num_blocks, t.full_q_indices)
    return found


def per_element(states: Any, batch_shape: tuple[int, ...], xp: Any = None) -> Any:
    """States ``(*lead, nq, nk)`` (``lead`` broadcasting against ``(*batch, H)``) merged
    over the heads, one per flat batch element: ``(B, nq, nk)``."""
    import numpy as np

    xp = np if xp is None else xp
    rank = len(batch_shape) + 3
    states = xp.reshape(states, (1,) * (rank - states.ndim) + tuple(states.shape))
    high, low = xp.max(states, axis=-3), xp.min(states, axis=-3)
    merged = xp.where(high == masks.HIDDEN, masks.HIDDEN,
                      xp.where(low == masks.FULL, masks.FULL, masks.PARTIAL)).astype(xp.int8)
    shape = merged.shape[-2:]
    merged = xp.broadcast_to(merged, (*batch_shape, *shape))
    return xp.reshape(merged, (math.prod(batch_shape), *shape))


def device_tables(states: Any) -> Tables:
    """The tables of states ``(..., n_q_blocks, n_kv_blocks)`` held in a JAX array."""
    import jax.numpy as jnp

    def lists(selected: Any) -> tuple[Any, Any]:
        counts = jnp.sum(selected, axis=-1, dtype=jnp.int32)
        order = jnp.argsort(~selected, axis=-1, stable=True).astype(jnp.int32)
        return counts, order

    partial, full = states == masks.PARTIAL, states == masks.FULL
    return Tables(*lists(partial), *lists(full), *lists(jnp.swapaxes(partial, -1, -2)),
                  *lists(jnp.swapaxes(full, -1, -2)))


def traced(mask: masks.Mask | None) -> bool:
    """Whether some array of ``mask`` cannot be read now (a tracer)."""
    return mask is not None and not all(values_readable(a) for a in mask.arrays)


def call_tables(inputs: AttentionInputs, plan: FlashPlan) -> Tables:
    """The tables of one call on the grid of ``plan``."""
    blocks = inputs.blocks(plan.block_q, plan.block_k)
    batch_shape = tuple(inputs.batch_shape) if plan.per_batch else None
    if not _conservative(inputs.mask):
        return host_tables(blocks, batch_shape)
    return device_tables(device_states(inputs, blocks, batch_shape))


def device_states(inputs: AttentionInputs, blocks: masks.BlockMask,
                  batch_shape: tuple[int, ...] | None = None) -> Any:
    """``(n_q_blocks, n_kv_blocks)`` int8 states of ``inputs.mask`` computed on the
    device, merged over batch elements and heads (hidden where hidden for all, full
    where full for all); with a ``batch_shape``, merged over heads only,
    ``(B, n_q_blocks, n_kv_blocks)``."""
    import jax.numpy as jnp

    grid = masks.Grid.uniform(blocks.q_len, blocks.kv_len, blocks.block_q, blocks.block_k)
    shape = (blocks.num_q_blocks, blocks.num_kv_blocks)
    states = inputs.mask.device_states(
        grid, jnp, len(inputs.batch_shape) + 3,
        lambda part: _evaluated(part, grid, inputs.batch_shape, inputs.num_heads))
    if batch_shape is not None:
        return per_element(jnp.broadcast_to(states, (*states.shape[:-2], *shape)),
                           batch_shape, jnp)
    lead = tuple(range(states.ndim - 2))
    high, low = jnp.max(states, axis=lead), jnp.min(states, axis=lead)
    merged = masks.tile_states(high == masks.HIDDEN, low == masks.FULL, jnp)
    return jnp.broadcast_to(merged, shape)


def _evaluated(part: masks.Mask, grid: masks.Grid, batch_shape: tuple[int, ...],
               num_heads: int) -> Any:
    """States from ``allows`` at every pair, one query block at a time, merged over
    batch elements and heads right away."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    lq, lk = grid.q_len, grid.kv_len
    bq, bk = int(grid.q_edges[1] - grid.q_edges[0]), int(grid.k_edges[1] - grid.k_edges[0])
    nq, nk = len(grid.q_edges) - 1, len(grid.k_edges) - 1
    flat = math.prod(batch_shape)
    b = jnp.reshape(jnp.arange(flat, dtype=jnp.int32), (flat, 1, 1, 1))
    h = jnp.reshape(jnp.arange(num_heads, dtype=jnp.int32), (1, num_heads, 1, 1))
    keys = jnp.arange(nk * bk, dtype=jnp.int32)
    k = jnp.reshape(jnp.minimum(keys, lk - 1), (1, 1, 1, -1))
    valid_k = keys < lk

    def one(a: Any) -> Any:
        rows = a * bq + jnp.arange(bq, dtype=jnp.int32)
        q = jnp.reshape(jnp.minimum(rows, lq - 1), (1, 1, -1, 1))
        with jax.numpy_rank_promotion("allow"):  # masks broadcast by the array API's rules
            allowed = jnp.asarray(part.allows(jnp, b, h, q, k, lq, lk), dtype=bool)
        allowed = jnp.reshape(allowed, (-1, *(1, 1, *allowed.shape)[-2:]))
        valid = (rows < lq)[:, None] & valid_k[None, :]
        some = jnp.any(allowed & valid[None], axis=(0, 1))
        every = jnp.all(allowed | ~valid[None], axis=(0, 1))
        return masks.tile_states(~jnp.any(jnp.reshape(some, (nk, bk)), axis=-1),
                                 jnp.all(jnp.reshape(every, (nk, bk)), axis=-1), jnp)

    return lax.map(one, jnp.arange(nq, dtype=jnp.int32))


def _conservative(mask: masks.Mask | None) -> bool:
    """Whether the host block form lacked values: traced arrays, or a mask function
    evaluated while JAX stages a program (inside ``jit`` every new array is a tracer)."""
    if mask is None:
        return False
    return traced(mask) or ("function" in mask.kinds and _staging())


def _staging() -> bool:
    import jax.numpy as jnp

    return not values_readable(jnp.zeros((), jnp.int32))
