"""``jax_flash`` for a band joined to global tokens (``sliding_window(w) |
global_tokens(positions)``, Longformer's and BigBird's local pattern) in three exact
parts merged by their log-sum-exps:

- the band alone, through the flash loops (its tiles only), with its log-sum-exp;
- every row against the global keys its band does not already hold, one dense
  ``(Lq, n)`` product;
- the global rows against every key, one dense ``(n, Lk)`` product, put in place of
  what the first two give them.

The band and global-key parts cover disjoint keys and merge exactly (the split-KV
identity of :func:`portattn.merge`). A spread of global tokens reaches every query
block of the flash grid, so the union's block form visits far more tiles than the
pattern holds pairs (25% of the tiles for 16 tokens and a window of 512 at L = 16384,
against 3.3% of the pairs); here each part costs its own pairs.

The positions stay arrays (traced under ``jit``): repeated entries count once,
negative ones are unused. Gradients: the flash part through its own backward, the
dense parts through JAX's autodiff.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from portattn import masks

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["DENSE_SCORES", "band_and_tokens", "local_attention"]

#: Most scores of a dense part, ``batch * Hq * n * max(Lq, Lk)``, that the three parts
#: take (512 MiB in float32); past it a call runs through the union's block form.
DENSE_SCORES = 1 << 27


def band_and_tokens(inputs: AttentionInputs) -> tuple[Any, Any] | None:
    """``(band part, global_tokens part)`` of a call ``band | global_tokens(positions)``
    that the three parts compute; None for any other call."""
    if inputs.bias is not None or inputs.dropout_p or inputs.sinks is not None \
            or inputs.alibi_slopes is not None or inputs.score_mod is not None:
        return None
    split = masks.band_and_tokens(inputs.mask)
    if split is None or split.band is None or split.tokens is None:
        return None
    n = split.tokens.positions.shape[-1]
    if math.prod(inputs.batch_shape) * inputs.num_heads * n * max(inputs.q_len,
                                                                   inputs.kv_len) \
            > DENSE_SCORES:
        return None  # the dense parts' scores would be too large: the block form
    return split.band, split.tokens


def local_attention(inputs: AttentionInputs, band_mask: Any, tokens: Any,
                    band_part: Any) -> tuple[Any, Any]:
    """``(out, lse)`` of ``band_mask | tokens``; ``band_part(inputs)`` gives ``(out,
    lse)`` of a call (here: the band alone) through the flash loops."""
    import jax.numpy as jnp
    from jax import lax

    from ._flash import compute_dtype

    highest = lax.Precision.HIGHEST  # GPUs would otherwise multiply float32 in TF32
    batch = tuple(inputs.batch_shape)
    flat = math.prod(batch)
    hq, hkv = inputs.num_heads, inputs.num_kv_heads
    group = hq // hkv
    lq, lk = inputs.q_len, inputs.kv_len
    d, dv = inputs.head_dim, inputs.value_head_dim
    ct = compute_dtype(inputs.query.dtype)
    band = band_mask.band(lq, lk)

    out1, lse1 = band_part(inputs._replace(mask=band_mask, mask_kinds=band_mask.kinds,
                                           return_lse=True))
    q = jnp.reshape(inputs.query, (flat, hkv, group, lq, d)).astype(ct)
    k = jnp.reshape(inputs.key, (flat, hkv, lk, d))
    v = jnp.reshape(inputs.value, (flat, hkv, lk, dv))
    out1 = jnp.reshape(out1, (flat, hkv, group, lq, dv)).astype(ct)
    lse1 = jnp.reshape(lse1, (flat, hkv, group, lq)).astype(ct)

    positions = tokens.positions
    n = positions.shape[-1]
    positions = jnp.broadcast_to(jnp.reshape(positions, (-1, n)), (flat, n)).astype(jnp.int32)
    # an entry counts if used, below Lk, and the first of its value
    earlier = jnp.tril(jnp.ones((n, n), bool), -1)
    repeated = jnp.any((positions[:, :, None] == positions[:, None, :]) & earlier[None], axis=-1)
    used = (positions >= 0) & (positions < lk) & ~repeated  # (F, n)
    index = jnp.where(used, positions, 0)

    def gathered(x: Any) -> Any:  # (F, Hkv, L, D) at the positions: (F, Hkv, n, D)
        at = jnp.broadcast_to(index[:, None, :, None], (flat, hkv, n, 1))
        return jnp.take_along_axis(x, at, axis=2)

    def scores(qx: Any, kx: Any) -> Any:
        s = jnp.einsum("fhgqd,fhkd->fhgqk", qx, kx.astype(ct), precision=highest)
        cap = inputs.softcap
        if cap:
            return cap * jnp.tanh(s * (inputs.scale / cap))
        return s * inputs.scale

    # (2) every row against the global keys outside its band
    # unused entries hold zeros: a key or value there (NaN, inf) reaches no row and no
    # gradient, as anything the mask hides
    kg = jnp.where(used[:, None, :, None], gathered(k), 0)
    vg = jnp.where(used[:, None, :, None], gathered(v).astype(ct), 0)
    offsets = index[:, None, :] - jnp.arange(lq, dtype=jnp.int32)[None, :, None]  # (F, Lq, n)
    # the band holds these pairs already (an open side bounded past every pair: the
    # same program whatever the lengths)
    lower = -lq if band.lower is None else band.lower
    upper = lk if band.upper is None else band.upper
    inside = (offsets >= lower) & (offsets <= upper)
    allowed = used[:, None, :] & ~inside
    s = jnp.where(allowed[:, None, None], scores(q, kg), -jnp.inf)
    top = lax.stop_gradient(jnp.max(s, axis=-1))
    shift = jnp.where(jnp.isfinite(top), top, 0)
    e = jnp.exp(s - shift[..., None])
    total = jnp.sum(e, axis=-1)
    some = total > 0
    safe_total = jnp.where(some, total, 1)
    lse2 = jnp.where(some, jnp.log(safe_total) + shift, -jnp.inf)
    out2 = jnp.einsum("fhgqk,fhkd->fhgqd", e, vg, precision=highest) / safe_total[..., None]

    # merge (1) and (2): disjoint keys
    big = jnp.maximum(lse1, lse2)
    big = lax.stop_gradient(jnp.where(jnp.isfinite(big), big, 0))
    w1, w2 = jnp.exp(lse1 - big), jnp.exp(lse2 - big)
    weight = w1 + w2
    seen = weight > 0
    safe_weight = jnp.where(seen, weight, 1)
    lse = jnp.where(seen, jnp.log(safe_weight) + big, lse1 + lse2)  # -inf, or NaN
    out = (out1 * w1[..., None] + out2 * w2[..., None]) / safe_weight[..., None]

    # (3) the global rows against every key, in place
    rows = positions - (lk - lq)  # query row of each position
    row_used = (positions >= 0) & (rows >= 0) & (rows < lq)
    row_index = jnp.where(row_used, rows, 0)
    qg = jnp.take_along_axis(
        q, jnp.broadcast_to(row_index[:, None, None, :, None], (flat, hkv, group, n, 1)),
        axis=3)
    kept = row_used[:, None, None, :, None]
    s3 = jnp.where(kept, scores(jnp.where(kept, qg, 0), k), 0)  # unused: no NaN leaks
    top3 = lax.stop_gradient(jnp.max(s3, axis=-1))
    shift3 = jnp.where(jnp.isfinite(top3), top3, 0)
    e3 = jnp.exp(s3 - shift3[..., None])
    total3 = jnp.sum(e3, axis=-1)
    lse3 = jnp.log(total3) + shift3
    out3 = jnp.einsum("fhgqk,fhkd->fhgqd", e3, v.astype(ct),
                      precision=highest) / total3[..., None]
    # which of the n entries each row is (if any)
    hits = (jnp.arange(lq, dtype=jnp.int32)[None, :, None] == row_index[:, None, :]) \
        & row_used[:, None, :]  # (F, Lq, n)
    is_global = jnp.any(hits, axis=-1)
    which = jnp.argmax(hits, axis=-1).astype(jnp.int32)  # (F, Lq)
    pick = jnp.broadcast_to(which[:, None, None, :], (flat, hkv, group, lq))
    out3 = jnp.take_along_axis(out3, pick[..., None], axis=3)
    lse3 = jnp.take_along_axis(lse3, pick, axis=3)
    where = is_global[:, None, None, :]
    out = jnp.where(where[..., None], out3, out)
    lse = jnp.where(where, lse3, lse)

    lead = (*batch, hq, lq)
    return (jnp.reshape(out, (*lead, dv)).astype(inputs.query.dtype),
            jnp.reshape(lse, lead))
