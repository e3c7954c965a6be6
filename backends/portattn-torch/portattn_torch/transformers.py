"""portattn as an attention implementation of Hugging Face transformers.

>>> import portattn_torch.transformers
>>> portattn_torch.transformers.register()
>>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="portattn")

:func:`register` adds portattn to both of transformers' public registries: the
attention function (``AttentionInterface``) and the mask builder
(``AttentionMaskInterface``). Registering the attention function alone is a trap:
transformers then builds no mask for the implementation at all, and padding is
silently ignored. With both, each layer gets a structured portattn mask (a causal or
sliding band, key ranges for padding, documents for packed sequences), so the fast
kernels and their tile skipping apply; masks transformers' rules do not describe
reach portattn as transformers' own boolean mask.

This module imports transformers; ``import portattn_torch`` does not.
"""

from __future__ import annotations

from typing import Any

try:
    import transformers as _transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - the message is the point
    msg = ("portattn_torch.transformers needs Hugging Face transformers: "
           "pip install transformers")
    raise ImportError(msg) from e

import portattn
from portattn import masks

from ._hf_masks import NOT_RECOGNISED, padding_mask, positional_mask

__all__ = ["NAME", "PreparedMask", "attention_forward", "build_mask", "register"]

NAME = "portattn"


def register(name: str = NAME) -> str:
    """Register portattn's attention function and mask builder under ``name`` (used as
    ``attn_implementation=name``); returns ``name``. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, build_mask)
    return name


class PreparedMask(masks.Intersection):
    """A portattn mask that transformers' code passes on as an already prepared mask.

    ``generate()`` with a static cache builds the masks before the forward pass and
    hands them back to the model, whose mask creation then asks for ``ndim``: only a
    2-D array is read as padding, anything else is passed through to
    :func:`build_mask`, which returns it as it is.
    """

    ndim = 4

    @classmethod
    def of(cls, mask: masks.Mask) -> PreparedMask:
        return mask if isinstance(mask, cls) else cls(mask.parts)


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
               kv_offset: int = 0, mask_function: Any = None, attention_mask: Any = None,
               **kwargs: Any) -> masks.Mask | None:
    """transformers' mask-interface call: the layer's mask as a portattn mask (None when
    every pair attends)."""
    mask = _build_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                       attention_mask, **kwargs)
    return None if mask is None else PreparedMask.of(mask)


def _build_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any,
                kv_offset: int, mask_function: Any, attention_mask: Any,
                **kwargs: Any) -> masks.Mask | None:
    from transformers import masking_utils as mu

    if isinstance(attention_mask, masks.Mask):  # built ahead by generate()
        return attention_mask
    if mask_function is None:
        mask_function = mu.causal_mask_function
    offset = _static_int(q_offset)
    positional = NOT_RECOGNISED if offset is None else positional_mask(
        mask_function, q_length, kv_length, offset, kv_offset)
    if positional is NOT_RECOGNISED:
        kwargs.pop("allow_is_causal_skip", None)
        kwargs.pop("allow_is_bidirectional_skip", None)
        allowed = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                               q_offset=q_offset, kv_offset=kv_offset,
                               mask_function=mask_function, attention_mask=attention_mask,
                               allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                               **kwargs)
        return None if allowed is None else masks.dense(allowed)
    padding = padding_mask(attention_mask, kv_length, kv_offset)
    if positional is None or padding is None:
        return positional if padding is None else padding
    return positional & padding


def _static_int(value: Any) -> int | None:
    """An offset as a Python int (a static cache gives a tensor), None while compiling."""
    import torch

    if not isinstance(value, torch.Tensor):
        return int(value)
    return None if torch.compiler.is_compiling() else int(value)


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                      dropout: float = 0.0, scaling: float | None = None,
                      softcap: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention-function call: ``query (B, Hq, Lq, D)``, ``key`` and
    ``value (B, Hkv, Lk, D)`` (grouped-query heads are not repeated); returns
    ``(output (B, Lq, Hq, Dv), None)``. ``attention_mask`` is what :func:`build_mask`
    made, or a 4-D tensor the caller prepared (boolean: True = attend; float: added)."""
    mask = bias = None
    if isinstance(attention_mask, masks.Mask):
        mask = attention_mask
    elif attention_mask is not None:
        # a prepared mask may be longer than the keys (a static cache): cut as eager does
        attention_mask = attention_mask[..., :key.shape[-2]]
        if attention_mask.dtype == _torch_bool():
            mask = masks.dense(attention_mask)
        else:
            bias = attention_mask
    out = portattn.attention(query, key, value, mask=mask, bias=bias, scale=scaling,
                             softcap=softcap, dropout_p=float(dropout or 0.0))
    return out.transpose(1, 2).contiguous(), None


def _torch_bool() -> Any:
    import torch

    return torch.bool
