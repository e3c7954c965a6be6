"""The reference kernel: materialises the whole score matrix. The numerical oracle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._dropout import seed_word
from ._portable import (
    PortableKernel,
    add_sinks,
    attend_values,
    cast,
    dropped,
    empty_result,
    empty_weights,
    finish,
    group_kv,
    group_queries,
    is_empty,
    kept,
    safe_max,
    scores_of_clean,
    split_nonfinite,
    ungroup,
    with_empty_rows,
)

if TYPE_CHECKING:
    from .._inputs import AttentionInputs


class ReferenceKernel(PortableKernel):
    """O(L^2) memory; the only portable kernel that returns the softmax weights."""

    name = "reference"
    returns_weights = True
    priority = 0

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        return reference_attention(inputs)


def reference_attention(inputs: AttentionInputs) -> tuple[Any, Any, Any]:
    xp = inputs.xp
    lq, lk = inputs.q_len, inputs.kv_len
    if is_empty(inputs):
        out, lse = empty_result(inputs)
        weights = empty_weights(inputs) if inputs.return_weights else None
        if inputs.requires_grad:
            out = out + _nothing_of(inputs, out.dtype)
        return out, lse if inputs.return_lse else None, weights
    ct = inputs.compute_dtype
    q = group_queries(xp, cast(xp, inputs.query, ct) * inputs.scale, inputs.num_kv_heads)
    k = group_kv(xp, cast(xp, inputs.key, ct))
    v, bad = split_nonfinite(xp, group_kv(xp, cast(xp, inputs.value, ct)))
    q, bad_q = split_nonfinite(xp, q)
    k, bad_k = split_nonfinite(xp, k)
    tile = scores_of_clean(inputs, q, bad_q, k, bad_k, 0, lq, 0, lk)
    m = safe_max(xp, tile.s)
    p = tile.weights(xp, m)
    denom = xp.sum(p, axis=-1, keepdims=True)
    weights, lse, has_mass = finish(xp, *add_sinks(inputs, p, m, denom))
    if inputs.dropout_p:  # the weights as applied: out = weights @ value
        weights = dropped(inputs, weights, kept(inputs, seed_word(inputs), 0, lq, 0, lk))
    out = cast(xp, ungroup(xp, attend_values(xp, weights, v, bad, tile)), inputs.query.dtype)
    return (
        out,
        ungroup(xp, with_empty_rows(xp, lse, has_mass), trailing=1)
        if inputs.return_lse else None,
        cast(xp, ungroup(xp, weights), inputs.query.dtype) if inputs.return_weights else None,
    )


def _nothing_of(inputs: AttentionInputs, dtype: Any) -> Any:
    """A 0 computed from no element of query, key, value and bias: adding it ties an
    empty call's zeros to the inputs, so autograd gives them (zero) gradients, as for
    any other call."""
    xp = inputs.xp
    arrays = [a for a in (inputs.query, inputs.key, inputs.value, inputs.bias, inputs.sinks)
              if a is not None]
    return sum(xp.sum(cast(xp, a[..., :0], dtype)) for a in arrays)
