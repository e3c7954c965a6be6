"""Block layouts and tile masks for the ``jax_flash`` loops.

Queries are grouped per key/value head, ``(B, Hkv, G, L, D)``, so one ``einsum`` with
keys ``(B, Hkv, L, D)`` serves the G query heads of each K/V head (K/V are never
repeated). Sequences are padded to whole blocks and stacked block-first,
``(n, B, Hkv, G, block, D)``, so every tile has one static shape and loops index
blocks with a traced counter. Padded keys are masked; padded queries are dropped.

A partial tile's mask is the mask's ``allows`` at the tile's traced indices; a bias
stays in its broadcast shape (size-1 axes kept) and its tiles are cut with
``lax.dynamic_slice`` at traced offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax, tree_util

__all__ = ["FlashPlan", "block_sizes", "key_padding", "tile_allowed"]

MIN_BLOCK_Q = 16


def block_sizes(rows: int, lq: int, lk: int, max_block: int,
                tile_elements: int) -> tuple[int, int]:
    """``(block_q, block_k)`` for ``rows = B * Hq`` rows of ``lq x lk`` scores: blocks
    of at most ``max_block``, ``rows * block_q * block_k <= tile_elements`` where
    ``block_q >= MIN_BLOCK_Q`` allows."""
    block_k = max(1, min(lk, max_block))
    budget = tile_elements // max(1, rows * block_k)
    block_q = min(max_block, max(MIN_BLOCK_Q, budget))
    return max(1, min(lq, block_q)), block_k


@dataclass(frozen=True)
class FlashPlan:
    """The static part of one call (hashable: it keys JAX's compilation cache)."""

    lq: int
    lk: int
    block_q: int
    block_k: int
    num_heads: int
    num_kv_heads: int
    scale: float
    softcap: float | None
    batch_shape: tuple[int, ...]
    """The call's batch dims (flattened to one here): masks read flat batch indices."""
    mask_tree: Any
    """The mask's pytree structure (its arrays are the loops' arguments)."""
    per_batch: bool = False
    """Batch elements run one at a time, each with its own block tables."""
    dropout_p: float = 0.0
    """Dropout's probability; its seed word is a traced argument of the loops."""

    @property
    def num_q_blocks(self) -> int:
        return -(-self.lq // self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return -(-self.lk // self.block_k)

    def mask(self, leaves: tuple[Any, ...]) -> Any:
        """The mask holding ``leaves`` (None without a mask)."""
        return tree_util.tree_unflatten(self.mask_tree, leaves)


def _pad_axis(x: Any, axis: int, size: int, value: Any = 0) -> Any:
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def query_blocks(x: Any, plan: FlashPlan, value: Any = 0) -> Any:
    """``(B, Hq, Lq, *rest) -> (nq, B, Hkv, G, block_q, *rest)`` (``rest``: 0 or 1 dims)."""
    b, hq, _, *rest = x.shape
    nq, bq, hkv = plan.num_q_blocks, plan.block_q, plan.num_kv_heads
    x = _pad_axis(x, 2, nq * bq, value)
    x = jnp.reshape(x, (b, hkv, hq // hkv, nq, bq, *rest))
    return jnp.moveaxis(x, 3, 0)


def unblock_queries(x: Any, plan: FlashPlan) -> Any:
    """The inverse of :func:`query_blocks`, padding dropped."""
    nq, b, hkv, g, bq, *rest = x.shape
    x = jnp.reshape(jnp.moveaxis(x, 0, 3), (b, hkv * g, nq * bq, *rest))
    return x[:, :, :plan.lq]


def key_blocks(x: Any, plan: FlashPlan) -> Any:
    """``(B, Hkv, Lk, D) -> (nk, B, Hkv, block_k, D)``."""
    b, hkv, _, d = x.shape
    nk, bk = plan.num_k_blocks, plan.block_k
    x = jnp.reshape(_pad_axis(x, 2, nk * bk), (b, hkv, nk, bk, d))
    return jnp.moveaxis(x, 2, 0)


def unblock_keys(x: Any, plan: FlashPlan) -> Any:
    nk, b, hkv, bk, d = x.shape
    return jnp.reshape(jnp.moveaxis(x, 0, 2), (b, hkv, nk * bk, d))[:, :, :plan.lk]


def grouped_full(x: Any, plan: FlashPlan, value: Any) -> Any:
    """A ``(B|1, Hq|1, Lq|1, Lk|1)`` bias or mask as ``(B|1, Hkv|1, G|1, Lq'|1, Lk'|1)``,
    padded to whole blocks on its full-length axes."""
    b, h, lq, lk = x.shape
    if lq != 1:
        x = _pad_axis(x, 2, plan.num_q_blocks * plan.block_q, value)
    if lk != 1:
        x = _pad_axis(x, 3, plan.num_k_blocks * plan.block_k, value)
    hkv = plan.num_kv_heads
    heads = (1, 1) if h == 1 else (hkv, h // hkv)
    return jnp.reshape(x, (b, *heads, *x.shape[2:]))


def ungroup_full(x: Any, plan: FlashPlan) -> Any:
    """The inverse of :func:`grouped_full`."""
    b, hkv, g, lq, lk = x.shape
    x = jnp.reshape(x, (b, hkv * g, lq, lk))
    return x[:, :, :plan.lq if lq != 1 else 1, :plan.lk if lk != 1 else 1]


def tile_of(full: Any, plan: FlashPlan, q0: Any, k0: Any) -> Any:
    """The ``block_q x block_k`` tile at ``(q0, k0)`` of a grouped full array."""
    rows = 1 if full.shape[3] == 1 else plan.block_q
    cols = 1 if full.shape[4] == 1 else plan.block_k
    zero = jnp.zeros((), jnp.int32)
    start = (zero, zero, zero, q0 if rows > 1 else zero, k0 if cols > 1 else zero)
    return lax.dynamic_slice(full, start, (*full.shape[:3], rows, cols))


def key_padding(plan: FlashPlan, k0: Any) -> Any:
    """``(1, 1, 1, 1, block_k)``: the keys of the block at ``k0`` that exist (None when
    every block is whole)."""
    if plan.lk % plan.block_k == 0:
        return None
    j = k0 + jnp.arange(plan.block_k, dtype=jnp.int32)
    return jnp.reshape(j < plan.lk, (1, 1, 1, 1, plan.block_k))


def tile_allowed(plan: FlashPlan, mask: Any, q0: Any, k0: Any, batch_index: Any = None) -> Any:
    """``(B|1, Hkv|1, G|1, block_q, block_k)`` booleans of the tile at traced ``(q0, k0)``:
    ``mask.allows`` at its indices (True = attend), padded keys hidden. ``batch_index``:
    the flat index of the one batch element computed (every one when None)."""
    if mask is None:  # no partial tile: the loop that would mask one never runs
        return key_padding(plan, k0)
    bq, bk, hkv = plan.block_q, plan.block_k, plan.num_kv_heads
    flat = math.prod(plan.batch_shape)
    # Padded rows and keys read the last real one (masks index arrays with them).
    i = jnp.minimum(q0 + jnp.arange(bq, dtype=jnp.int32), plan.lq - 1)
    j = jnp.minimum(k0 + jnp.arange(bk, dtype=jnp.int32), plan.lk - 1)
    b = jnp.arange(flat, dtype=jnp.int32) if batch_index is None else batch_index
    b = jnp.reshape(b, (-1, 1, 1, 1, 1))
    heads = jnp.arange(plan.num_heads, dtype=jnp.int32)
    h = jnp.reshape(heads, (1, hkv, plan.num_heads // hkv, 1, 1))
    # Masks broadcast by the array API's rules (several ranks at once).
    with jax.numpy_rank_promotion("allow"):
        allowed = mask.allows(jnp, b, h, jnp.reshape(i, (1, 1, 1, bq, 1)),
                              jnp.reshape(j, (1, 1, 1, 1, bk)), plan.lq, plan.lk)
    allowed = jnp.asarray(allowed, dtype=bool)
    allowed = jnp.reshape(allowed, (1,) * (5 - allowed.ndim) + allowed.shape)
    padding = key_padding(plan, k0)
    return allowed if padding is None else allowed & padding
