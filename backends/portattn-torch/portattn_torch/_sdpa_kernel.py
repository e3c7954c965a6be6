"""The ``torch_sdpa`` kernel: torch tensors through ``F.scaled_dot_product_attention``.

SDPA picks torch's best kernel for the device (flash, memory-efficient, cuDNN, the CPU
flash kernel or the math fallback) and brings autograd and dropout. What SDPA cannot
give exactly is declared unsupported, so dispatch runs the portable kernels instead:

- ``softcap`` and ``return_lse``: SDPA has neither. FlexAttention has both, but in
  eager mode it materialises the whole score matrix (with a warning) and has no
  backward pass on CPU, so the tiled kernel does better.
- ``return_weights``: SDPA never forms the softmax matrix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from portattn.kernel import ANY, Kernel

from ._availability import torch_unavailable
from ._translate import as_4d, sdpa_mask

if TYPE_CHECKING:
    from portattn import AttentionInputs

_MASKS = frozenset({"causal", "sliding_window", "key_lengths", "query_lengths", "dense"})


class TorchSDPAKernel(Kernel):
    """torch's fused attention kernels, with autograd, on any torch device."""

    name = "torch_sdpa"
    namespaces = frozenset({"torch"})
    devices = ANY
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})
    masks = _MASKS
    bias = gqa = value_head_dim = empty = True
    dropout = grad = True
    # The CUDA backward passes accumulate with atomics; dropout draws from torch's RNG.
    deterministic = False
    priority = 100

    @classmethod
    def check_available(cls) -> str | None:
        return torch_unavailable()

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        return sdpa_attention(inputs), None, None


def sdpa_attention(inputs: AttentionInputs) -> Any:
    """The attention output of ``inputs`` (torch tensors) computed by SDPA."""
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = inputs.query, inputs.key, inputs.value
    gqa = inputs.num_heads != inputs.num_kv_heads
    batch = inputs.batch_shape
    if inputs.q_len == 0 or inputs.kv_len == 0:
        shape = (*batch, inputs.num_heads, inputs.q_len, inputs.value_head_dim)
        return torch.zeros(shape, dtype=q.dtype, device=q.device)
    if inputs.mask is None and inputs.bias is None and len(batch) == 1:
        # The common call, kept as short as calling SDPA directly.
        return sdpa(q, k, v, dropout_p=inputs.dropout_p, scale=inputs.scale, enable_gqa=gqa)
    spec = sdpa_mask(inputs)
    attn_mask = spec.attn_mask
    if len(batch) != 1:
        q, k, v = (as_4d(x, batch) for x in (q, k, v))
        if isinstance(attn_mask, torch.Tensor):
            attn_mask = as_4d(attn_mask, batch)
    out = sdpa(q, k, v, attn_mask=attn_mask, dropout_p=inputs.dropout_p,
               is_causal=spec.is_causal, scale=inputs.scale, enable_gqa=gqa)
    if len(batch) != 1:
        out = out.reshape(*batch, *out.shape[1:])
    if spec.keep is not None:
        out = torch.where(spec.keep, out, 0.0)
    return out
