"""The portable flash kernel's gradients in torch autograd.

``attach_autograd`` is what this plugin adds to portattn for torch's autograd
(``_library``): the ``tiled`` kernel calls it for tensors that need gradients.
The forward runs without recording (inside ``autograd.Function.forward``) and saves
only ``query, key, value, bias, sinks, out, lse`` and a score change's arrays; the
backward is portattn's
FlashAttention-2 pass, which recomputes each tile from the saved log-sum-exp. Memory
for forward and backward together stays O(L * block).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from portattn.autograd import flash_backward, flash_forward

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["attach_autograd"]


def attach_autograd(inputs: AttentionInputs) -> tuple[Any, Any]:
    """``(out, lse)`` of ``inputs`` with a flash backward attached."""
    tables = () if inputs.score_mod is None else inputs.score_mod.arrays
    return _FlashAttention.apply(inputs.query, inputs.key, inputs.value, inputs.bias,
                                 inputs.sinks, _Description(inputs), *tables)


class _Description:
    """The call without its differentiable tensors (kept by the autograd node)."""

    def __init__(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs._replace(query=None, key=None, value=None, bias=None, sinks=None)

    def with_tensors(self, query: Any, key: Any, value: Any, bias: Any, sinks: Any,
                     tables: tuple[Any, ...]) -> AttentionInputs:
        change = self.inputs.score_mod
        return self.inputs._replace(
            query=query, key=key, value=value, bias=bias, sinks=sinks,
            score_mod=None if change is None else change.with_arrays(tables))


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: Any, key: Any, value: Any, bias: Any, sinks: Any,
                description: _Description, *tables: Any) -> tuple[Any, Any]:
        out, lse = flash_forward(description.with_tensors(query, key, value, bias, sinks,
                                                          tables))
        ctx.save_for_backward(query, key, value, bias, sinks, out, lse, *tables)
        ctx.description = description
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Any, dlse: Any) -> tuple[Any, ...]:
        query, key, value, bias, sinks, out, lse, *tables = ctx.saved_tensors
        inputs = ctx.description.with_tensors(query, key, value, bias, sinks, tuple(tables))
        grads = flash_backward(inputs, out, lse, dout, dlse,
                               bias_grad=bias is not None and ctx.needs_input_grad[3])
        *tensors, table_grads = grads
        return *tensors, None, *(table_grads or ())
