"""Torch autograd for the Triton kernels: forward saves ``q, k, v, out, lse`` only.

The backward recomputes probabilities from ``lse`` (O(L) memory for forward plus
backward) and takes gradients of both outputs, ``out`` and ``lse``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ._launch import Band, band, flash_forward
from ._launch_backward import flash_backward

if TYPE_CHECKING:
    import torch

    from ._configs import BackwardConfig, Config

__all__ = ["flash_attention"]


@functools.cache
def _function() -> type:
    import torch

    class FlashAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, options: dict,
                    backward_config: Any) -> tuple[Any, Any]:
            out, lse = flash_forward(q, k, v, **options)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.options = options
            ctx.backward_config = backward_config
            ctx.set_materialize_grads(False)  # an unused output's gradient stays None
            return out, lse

        @staticmethod
        def backward(ctx: Any, dout: Any, dlse: Any) -> tuple[Any, ...]:
            q, k, v, out, lse = ctx.saved_tensors
            options = {n: x for n, x in ctx.options.items() if n != "config"}
            dq, dk, dv = flash_backward(q, k, v, out, lse, dout, dlse,
                                        config=ctx.backward_config, **options)
            return dq, dk, dv, None, None

    return FlashAttention


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                    scale: float | None = None, softcap: float | None = None,
                    causal: str | None = None,
                    window: tuple[int | None, int | None] | None = None,
                    band_offsets: Band = (None, None),
                    key_lengths: torch.Tensor | None = None,
                    query_lengths: torch.Tensor | None = None,
                    config: Config | None = None,
                    backward_config: BackwardConfig | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_forward` that torch autograd differentiates: ``(out, lse)``, with
    gradients of both for ``query``, ``key`` and ``value`` (through
    :func:`flash_backward`; ``backward_config`` fixes its block sizes)."""
    import torch

    lower_upper = band(query.shape[-2], key.shape[-2], causal, window, band_offsets)
    options = {"scale": scale, "softcap": softcap, "band_offsets": lower_upper,
               "key_lengths": key_lengths, "query_lengths": query_lengths,
               "config": config}
    wants_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad)
    if not wants_grad:
        return flash_forward(query, key, value, **options)
    return _function().apply(query, key, value, options, backward_config)
