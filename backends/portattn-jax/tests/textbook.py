"""Attention as the textbook writes it (softmax of masked scores), for gradient oracles.

Written in plain ``jax.numpy`` on the whole score matrix, so ``jax.grad`` of it in
float64 is the reference the flash backward is checked against. Masks are given as
one boolean ``allowed`` array; rows without an allowed key give 0 and lse ``-inf``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from portattn import masks


def textbook(q: Any, k: Any, v: Any, *, allowed: Any = None, bias: Any = None,
             scale: float | None = None, softcap: float | None = None) -> tuple[Any, Any]:
    """``(out, lse)`` of ``softmax(mask(softcap(scale * q k^T) + bias)) v``."""
    group = q.shape[-3] // k.shape[-3]
    k, v = jnp.repeat(k, group, axis=-3), jnp.repeat(v, group, axis=-3)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("...qd,...kd->...qk", q, k) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    ok = s > -jnp.inf if allowed is None else allowed & (s > -jnp.inf)
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
    e = jnp.where(ok, jnp.exp(s - m), 0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    safe = jnp.where(total > 0, total, 1)
    out = jnp.einsum("...qk,...kd->...qd", e, v) / safe
    lse = jnp.where(total > 0, jnp.log(safe) + m, -jnp.inf)[..., 0]
    return out, lse


def allowed_of(mask: masks.Mask | None, batch: tuple[int, ...], hq: int, lq: int,
               lk: int) -> Any:
    """The boolean ``(*batch, Hq, Lq, Lk)`` matrix of a NumPy-backed portattn mask."""
    if mask is None:
        return np.ones((*batch, hq, lq, lk), dtype=bool)
    import array_api_compat.numpy as xp

    bound = mask.bind(xp, batch, hq, lq, lk)
    tile = np.asarray(bound.tile(xp, 0, lq, 0, lk, lq, lk))
    return np.broadcast_to(tile, (*batch, hq, lq, lk))


def weighted_loss(out: Any, lse: Any, w_out: Any, w_lse: Any) -> Any:
    """A loss that reads every output and every finite lse with its own weight."""
    finite = jnp.isfinite(lse)
    return jnp.sum(out * w_out) + jnp.sum(jnp.where(finite, lse, 0) * w_lse)
