"""The ``jax_flash`` loops as one differentiable, compiled call.

With ``plan.per_batch`` the batch elements run one after another (a ``lax.scan``), each
with its own row of the block tables: packed rows whose documents (or lengths) differ
then each skip their own tiles, instead of visiting every tile some row needs. A bias
shared by the batch, and a bias by distance (a score change's), get the sum of the
elements' gradients, in the elements' order.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from ._flash import backward, forward, varying_like

if TYPE_CHECKING:
    from ._flash_layout import FlashPlan
    from ._flash_tables import Tables

__all__ = ["flash_attention", "forward_all"]


def _per_element(bias: Any) -> bool:
    return bias is not None and bias.shape[0] > 1


def forward_all(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, mask_leaves: tuple,
                tables: Tables, word: Any = None,
                distances: Any = None) -> tuple[Any, Any, Any]:
    """:func:`forward` over the whole batch: ``(out, lse, tiles)``."""
    if not plan.per_batch:
        return forward(plan, q, k, v, bias, mask_leaves, tables, word, distances=distances)
    own_bias = _per_element(bias)

    def step(tiles, xs):
        b, qe, ke, ve, bias_e, table = xs
        out, lse, n = forward(plan, qe[None], ke[None], ve[None],
                              bias_e[None] if own_bias else bias, mask_leaves, table,
                              word, batch_index=b, distances=distances)
        return tiles + n, (out[0], lse[0])

    xs = (jnp.arange(q.shape[0], dtype=jnp.int32), q, k, v, bias if own_bias else None,
          tables)
    tiles, (out, lse) = lax.scan(step, jnp.zeros((), jnp.int32), xs)
    return out, lse, tiles


def backward_all(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, mask_leaves: tuple,
                 tables: Tables, out: Any, lse: Any, dout: Any, dlse: Any,
                 bias_grad: bool, word: Any = None, distances: Any = None,
                 distance_grad: bool = False) -> tuple[Any, Any, Any, Any, Any, Any]:
    """:func:`backward` over the whole batch: ``(dq, dk, dv, dbias, ddistances,
    tiles)``."""
    if not plan.per_batch:
        return backward(plan, q, k, v, bias, mask_leaves, tables, out, lse, dout, dlse,
                        bias_grad, word, distances=distances, distance_grad=distance_grad)
    own_bias = _per_element(bias)
    shared_grad = bias_grad and bias is not None and not own_bias
    distance_grad = distance_grad and distances is not None

    def step(carry, xs):
        tiles, dbias_sum, ddist_sum = carry
        b, qe, ke, ve, bias_e, table, oute, lsee, doute, dlsee = xs
        dq, dk, dv, dbias, ddist, n = backward(
            plan, qe[None], ke[None], ve[None], bias_e[None] if own_bias else bias,
            mask_leaves, table, oute[None], lsee[None], doute[None],
            None if dlsee is None else dlsee[None], bias_grad, word, batch_index=b,
            distances=distances, distance_grad=distance_grad)
        if shared_grad:
            dbias_sum = dbias_sum + dbias
        if distance_grad:
            ddist_sum = ddist_sum + ddist
        own = dbias[0] if bias_grad and own_bias else None
        return (tiles + n, dbias_sum, ddist_sum), (dq[0], dk[0], dv[0], own)

    xs = (jnp.arange(q.shape[0], dtype=jnp.int32), q, k, v, bias if own_bias else None,
          tables, out, lse, dout, dlse)
    ct = out.dtype
    dbias0 = jnp.zeros(bias.shape, ct) if shared_grad else None
    ddist0 = jnp.zeros(distances.shape, ct) if distance_grad else None
    init = (jnp.zeros((), jnp.int32),
            *varying_like((dbias0, ddist0), q, k, v, bias, mask_leaves, tables, out, lse,
                          dout, dlse, word, distances))
    (tiles, dbias_sum, ddist_sum), (dq, dk, dv, dbias) = lax.scan(step, init, xs)
    return dq, dk, dv, dbias_sum if shared_grad else dbias, ddist_sum, tiles


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, mask_leaves: tuple,
           tables: Tables, word: Any, distances: Any) -> tuple[Any, Any]:
    out, lse, _ = forward_all(plan, q, k, v, bias, mask_leaves, tables, word, distances)
    return out.astype(q.dtype), lse


def _flash_fwd(plan, q, k, v, bias, mask_leaves, tables, word, distances):
    # symbolic_zeros: each leaf comes with whether it is differentiated at all.
    bias_grad = bias is not None and bias.perturbed
    distance_grad = distances is not None and distances.perturbed
    q, k, v, bias, mask_leaves, tables, word, distances = custom_vjp_primal_tree_values(
        (q, k, v, bias, mask_leaves, tables, word, distances))
    out, lse, _ = forward_all(plan, q, k, v, bias, mask_leaves, tables, word, distances)
    # Structure is static: a residual (), not None, says the bias (or the bias by
    # distance) wants a gradient.
    res = (q, k, v, bias, mask_leaves, tables, word, distances, out, lse,
           () if bias_grad else None, () if distance_grad else None)
    return (out.astype(q.dtype), lse), res


def _flash_bwd(plan, res, cotangents):
    (q, k, v, bias, mask_leaves, tables, word, distances, out, lse, bias_grad,
     distance_grad) = res
    dout, dlse = (None if isinstance(c, SymbolicZero) else c for c in cotangents)
    if dout is None:
        dout = jnp.zeros_like(out)
    dq, dk, dv, dbias, ddist, _ = backward_all(
        plan, q, k, v, bias, mask_leaves, tables, out, lse, dout, dlse,
        bias_grad is not None, word, distances, distance_grad is not None)
    dbias = None if dbias is None else dbias.astype(bias.dtype)
    ddist = None if ddist is None else ddist.astype(distances.dtype)
    # the mask's arrays, the tables and the seed are integers or booleans: no cotangent
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias,
            tuple(None for _ in mask_leaves), type(tables)(*(None for _ in tables)), None,
            ddist)


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


@partial(jax.jit, static_argnums=(0,))
def flash_attention(plan: FlashPlan, q: Any, k: Any, v: Any, bias: Any, mask_leaves: tuple,
                    tables: Tables, word: Any = None, distances: Any = None) -> tuple[Any, Any]:
    """``(out, lse)`` for ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk,
    Dv)``, an optional bias ``(B|1, Hq|1, Lq|1, Lk|1)``, the arrays of the mask whose
    structure ``plan`` holds, the call's block tables (a leading batch axis with
    ``plan.per_batch``), dropout's seed word (None without dropout) and an optional
    bias by distance ``(Hq, Lq + Lk - 1)`` (a score change's); differentiable in q, k,
    v, bias and the bias by distance (and through lse)."""
    return _flash(plan, q, k, v, bias, mask_leaves, tables, word, distances)
