"""JAX autograd for the portable ``tiled`` kernel: what this plugin adds as JAX's
``attach_autograd`` (``_library``).

:func:`attach_autograd` runs the core's tiled forward inside a ``jax.custom_vjp``
whose backward is the core's portable FlashAttention-2 backward, so JAX saves only
``query, key, value, bias, sinks, out, lse`` (and the mask, and a score change's
arrays) instead of recording every tile.
The mask's arrays, the ALiBi slopes and dropout's seed words are arguments (they get no
cotangent); the mask's structure is static.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from ._pytree import register_mask_pytrees

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["attach_autograd"]

_ARRAYS = ("query", "key", "value", "bias", "sinks", "alibi_slopes", "dropout_seed", "mask",
           "score_mod")


def attach_autograd(inputs: AttentionInputs) -> tuple[Any, Any]:
    """``flash_forward(inputs)``, differentiated by JAX with ``flash_backward``."""
    from jax import tree_util

    register_mask_pytrees()
    # The custom_vjp must not close over traced arrays: only the static rest of the
    # description is held aside, the arrays are its arguments. The mask goes in as
    # its leaves (the rule's own leaf wrappers would not rebuild a mask).
    leaves, treedef = tree_util.tree_flatten(inputs.mask)
    # A score change goes in as its arrays, its structure held aside with the mask's.
    change = inputs.score_mod
    tables = () if change is None else tuple(change.arrays)
    shape_only = None if change is None else change.with_arrays((None,) * len(tables))
    static = (inputs._replace(**dict.fromkeys(_ARRAYS)), treedef, shape_only)
    return _wired()(static, inputs.query, inputs.key, inputs.value, inputs.bias,
                    inputs.sinks, inputs.alibi_slopes, inputs.dropout_seed, tuple(leaves),
                    tables)


def _with(static: tuple[AttentionInputs, Any, Any], arrays: tuple[Any, ...]) -> AttentionInputs:
    inputs, treedef, change = static
    *tensors, leaves, tables = arrays
    mask = treedef.unflatten(leaves)
    change = None if change is None else change.with_arrays(tables)
    return inputs._replace(**dict(zip(_ARRAYS, (*tensors, mask, change), strict=True)))


_cache: list[Any] = []


def _wired() -> Any:
    """The ``custom_vjp`` function, built once (JAX is imported by the first call)."""
    if _cache:
        return _cache[0]
    import jax
    import jax.numpy as jnp
    from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

    from portattn.autograd import flash_backward, flash_forward

    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def wired(static, query, key, value, bias, sinks, alibi_slopes, dropout_seed,
              mask_leaves, tables):
        return flash_forward(_with(static, (query, key, value, bias, sinks, alibi_slopes,
                                            dropout_seed, mask_leaves, tables)))

    def fwd(static, *arrays):
        bias = arrays[3]
        bias_grad = bias is not None and bias.perturbed  # symbolic_zeros: per leaf
        arrays = custom_vjp_primal_tree_values(arrays)
        out, lse = flash_forward(_with(static, arrays))
        # The residuals' structure is static: (), not None, asks for the bias gradient.
        return (out, lse), (arrays, out, lse, () if bias_grad else None)

    def bwd(static, res, cotangents):
        arrays, out, lse, bias_grad = res
        dout, dlse = (None if isinstance(c, SymbolicZero) else c for c in cotangents)
        if dout is None:
            dout = jnp.zeros_like(out)
        grads = flash_backward(_with(static, arrays), out, lse, dout, dlse,
                               bias_grad=bias_grad is not None)
        *tensors, table_grads = grads
        # ALiBi slopes, the seed and the mask are constants; so are a change's indices
        return (*tensors, None, None, tuple(None for _ in arrays[7]),
                tuple(table_grads or ()))

    wired.defvjp(fwd, bwd, symbolic_zeros=True)
    _cache.append(wired)
    return wired
