"""Block layouts, tile masks and loop bounds for the ``jax_flash`` loops.

Queries are grouped per key/value head, ``(B, Hkv, G, L, D)``, so one ``einsum`` with
keys ``(B, Hkv, L, D)`` serves the G query heads of each K/V head (K/V are never
repeated). Sequences are padded to whole blocks and stacked block-first,
``(n, B, Hkv, G, block, D)``, so every tile has one static shape and loops index
blocks with a traced counter. Padded keys are masked; padded queries are dropped.

Bias and dense masks stay in their broadcast shape (size-1 axes kept) and their
tiles are cut with ``lax.dynamic_slice`` at traced offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
    from ._translate import Band

__all__ = ["FlashPlan", "block_sizes", "key_block_range", "query_block_range"]

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
    num_kv_heads: int
    scale: float
    softcap: float | None
    band: Band | None

    @property
    def num_q_blocks(self) -> int:
        return -(-self.lq // self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return -(-self.lk // self.block_k)


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


def tile_allowed(plan: FlashPlan, q0: Any, k0: Any, kl: Any, ql: Any, dense: Any) -> Any:
    """Boolean ``(B|1, 1|Hkv, 1|G, block_q, block_k)``: True = attend."""
    i = q0 + jnp.arange(plan.block_q, dtype=jnp.int32)[:, None]
    j = k0 + jnp.arange(plan.block_k, dtype=jnp.int32)[None, :]
    allowed = j < plan.lk  # padded keys
    band = plan.band
    if band is not None and band.left is not None:
        allowed = allowed & (j - i >= -band.left)
    if band is not None and band.right is not None:
        allowed = allowed & (j - i <= band.right)
    allowed = allowed[None, None, None]
    if kl is not None:
        allowed = allowed & (j < kl[:, None, None, None, None])
    if ql is not None:
        allowed = allowed & (i < ql[:, None, None, None, None])
    if dense is not None:
        allowed = allowed & tile_of(dense, plan, q0, k0)
    return allowed


def _ceil_div(a: Any, b: int) -> Any:
    return -(-a // b)


def key_block_range(plan: FlashPlan, iq: Any, kl: Any, ql: Any) -> tuple[Any, Any]:
    """Half-open range of key blocks that query block ``iq`` can reach (traced ints)."""
    q0 = iq * plan.block_q
    q1 = jnp.minimum(q0 + plan.block_q, plan.lq)
    lo, hi = jnp.zeros_like(q0), jnp.full_like(q0, plan.lk)
    band = plan.band
    if band is not None and band.left is not None:
        lo = jnp.maximum(lo, q0 - band.left)
    if band is not None and band.right is not None:
        hi = jnp.minimum(hi, q1 + band.right)
    if kl is not None:
        hi = jnp.minimum(hi, jnp.max(kl).astype(q0.dtype))
    if ql is not None:  # a block past every query length has no row to compute
        hi = jnp.where(q0 < jnp.max(ql).astype(q0.dtype), hi, lo)
    lo_block = jnp.clip(lo // plan.block_k, 0, plan.num_k_blocks)
    hi_block = jnp.clip(_ceil_div(hi, plan.block_k), lo_block, plan.num_k_blocks)
    return lo_block, hi_block


def query_block_range(plan: FlashPlan, ik: Any, kl: Any, ql: Any) -> tuple[Any, Any]:
    """Half-open range of query blocks that can see key block ``ik`` (traced ints)."""
    k0 = ik * plan.block_k
    k1 = jnp.minimum(k0 + plan.block_k, plan.lk)
    lo, hi = jnp.zeros_like(k0), jnp.full_like(k0, plan.lq)
    band = plan.band
    if band is not None and band.right is not None:  # j <= i + right
        lo = jnp.maximum(lo, k0 - band.right)
    if band is not None and band.left is not None:  # j >= i - left
        hi = jnp.minimum(hi, k1 + band.left)
    if ql is not None:
        hi = jnp.minimum(hi, jnp.max(ql).astype(k0.dtype))
    if kl is not None:
        hi = jnp.where(k0 < jnp.max(kl).astype(k0.dtype), hi, lo)
    lo_block = jnp.clip(lo // plan.block_q, 0, plan.num_q_blocks)
    hi_block = jnp.clip(_ceil_div(hi, plan.block_q), lo_block, plan.num_q_blocks)
    return lo_block, hi_block

