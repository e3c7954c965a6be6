"""Torch autograd for the Triton kernels: forward saves ``q, k, v, out, lse`` only
(and a score change's tables, so that changing them in place before the backward
raises, as torch does for its own saved tensors).

The backward recomputes probabilities from ``lse`` (O(L) memory for forward plus
backward), and dropout's kept pairs from its seed word, and takes gradients of both
outputs, ``out`` and ``lse``, for the query, key and value, for the bias when it
requires one, and for the tables of a score change by distance that require them
(through the gradient of its by-distance array, ``_distance``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ._distance import table_gradients
from ._launch import forward
from ._launch_backward import backward
from ._launching import check_shapes
from ._plan import plan_for

if TYPE_CHECKING:
    import torch

    from portattn.masks import Mask
    from portattn.scores import ScoreChange

    from ._configs import BackwardConfig, Config
    from ._plan import MaskPlan
    from ._triton_dropout import Dropout

__all__ = ["attention", "flash_attention"]


@functools.cache
def _function() -> type:
    import torch

    class FlashAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, bias: Any, plan: MaskPlan,
                    options: dict, backward_config: Any, *tables: Any) -> tuple[Any, Any]:
            out, lse = forward(q, k, v, plan, **options)
            ctx.save_for_backward(q, k, v, out, lse, *tables)
            ctx.plan, ctx.bias = plan, bias
            ctx.options = {n: options[n] for n in ("scale", "softcap", "dropout")}
            ctx.backward_config = backward_config
            ctx.set_materialize_grads(False)  # an unused output's gradient stays None
            return out, lse

        @staticmethod
        def backward(ctx: Any, dout: Any, dlse: Any) -> tuple[Any, ...]:
            q, k, v, out, lse, *tables = ctx.saved_tensors
            wants_bias = ctx.bias is not None and ctx.needs_input_grad[3]
            wants_tables = tuple(ctx.needs_input_grad[7:])
            dq, dk, dv, dbias, ddistance = backward(
                q, k, v, out, lse, dout, dlse, ctx.plan, config=ctx.backward_config,
                bias_like=ctx.bias if wants_bias else None, distance_grad=any(wants_tables),
                **ctx.options)
            dtables = ()
            if tables:
                dtables = table_gradients(ctx.plan.distance, ddistance, wants_tables,
                                          ctx.plan.q_len, ctx.plan.kv_len)
            return dq, dk, dv, dbias, None, None, None, *dtables

    return FlashAttention


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                    scale: float | None = None, softcap: float | None = None,
                    mask: Mask | None = None, causal: str | None = None,
                    window: tuple[int | None, int | None] | None = None,
                    key_lengths: torch.Tensor | None = None,
                    query_lengths: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None,
                    score_mod: ScoreChange | None = None,
                    config: Config | None = None,
                    backward_config: BackwardConfig | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_forward` that torch autograd differentiates: ``(out, lse)``, with
    gradients of both for ``query``, ``key``, ``value``, ``bias`` and the tables of
    ``score_mod`` (through :func:`flash_backward`'s kernels; ``backward_config`` fixes
    their block sizes)."""
    check_shapes(query, key, value)
    plan = plan_for(query, key, mask=mask, causal=causal, window=window,
                    key_lengths=key_lengths, query_lengths=query_lengths, bias=bias,
                    score_mod=score_mod)
    return attention(query, key, value, plan, bias=bias, scale=scale, softcap=softcap,
                     config=config, backward_config=backward_config)


def attention(query: Any, key: Any, value: Any, plan: MaskPlan, *, bias: Any = None,
              scale: float | None, softcap: float | None, config: Config | None = None,
              backward_config: BackwardConfig | None = None,
              dropout: Dropout | None = None) -> tuple[Any, Any]:
    """:func:`flash_attention` with the mask, bias and score change already planned
    (``bias`` is the tensor ``plan.bias`` views, for its gradient), and ``dropout`` if
    any."""
    import torch

    options = {"scale": scale, "softcap": softcap, "config": config, "dropout": dropout}
    arrays = () if plan.distance is None else tuple(plan.distance.change.arrays)
    # other libraries' tables (through DLPack) get no gradient: the kernel refuses those
    tables = arrays if all(isinstance(t, torch.Tensor) for t in arrays) else ()
    tensors = (query, key, value, *tables) if bias is None else (query, key, value, bias,
                                                                 *tables)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return forward(query, key, value, plan, **options)
    return _function().apply(query, key, value, bias, plan, options, backward_config,
                             *tables)
