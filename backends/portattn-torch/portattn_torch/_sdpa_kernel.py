"""The ``torch_sdpa`` kernel: torch tensors through ``F.scaled_dot_product_attention``.

SDPA picks torch's best kernel for the device (flash, memory-efficient, cuDNN, the CPU
flash kernel or the math fallback) and brings autograd and dropout. What SDPA cannot
give exactly is declared unsupported, so dispatch runs the portable kernels instead,
and what it gives slower is a preference (the last item; ``kernel="torch_sdpa"`` runs
it):

- ``softcap``, ``alibi_slopes``, ``sinks`` and ``return_lse``: SDPA has none of them.
  ``torch_flex`` (compiled FlexAttention) takes long calls with all but sinks;
  the tiled kernel the rest.
- ``return_weights``: SDPA never forms the softmax matrix.
- non-finite inputs (``finite_inputs_only``): SDPA lets a NaN the mask hides reach the
  output through ``0 * NaN``; on the CPU dispatch checks the output and runs another
  kernel then. Where no value can be read (accelerators, torch.compile) the call
  keeps the rule itself (``_nonfinite``). (Its CPU kernel also gives 0 for a row with
  a NaN query or overflowing scores: below 16 keys it is given a mask tensor, and
  bfloat16 calls whose scores may overflow float32 run in float32; see
  ``_translate``.)
- gradients through a structured mask that SDPA could only take as a dense
  ``(Lq, Lk)`` mask built here, when the mask has a bounded window (measured at
  L = 512...4096, 8 heads, head dim 64, float32 CPU: forward + backward with ``tiled``
  took 0.2-0.9x SDPA's time, as the flash backward skips the tiles outside the
  band), or without one when the scores exceed :data:`DENSE_GRAD_SCORES` (there the
  dense mask and its backward cost more time, and O(L^2) memory against O(L)). Smaller
  calls stay with SDPA, which is faster there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from portattn.kernel import ANY, Kernel
from portattn.masks import KINDS
from portattn.nonfinite import clear_keys, poison

from ._availability import torch_unavailable
from ._nonfinite import rows_seeing
from ._translate import (
    as_4d,
    band_of,
    bias_reasons,
    needs_mask_tensor,
    restricts,
    scores_may_overflow,
    sdpa_mask,
    structured_form,
)

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

#: Above this many scores per head (2048 x 2048), a dense mask built for a backward
#: pass is slower than the tiled flash backward (measured with causal & key_lengths);
#: with a bounded window, already above 512 x 512.
DENSE_GRAD_SCORES = 2048 * 2048
DENSE_GRAD_SCORES_WINDOW = 512 * 512


class TorchSDPAKernel(Kernel):
    """torch's fused attention kernels, with autograd, on any torch device."""

    name = "torch_sdpa"
    namespaces = frozenset({"torch"})
    devices = ANY
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})
    # every kind: what SDPA cannot take as is_causal or torch's causal bias becomes one
    # boolean mask built from the mask's tile (see _translate)
    masks = frozenset(KINDS)
    bias = gqa = value_head_dim = empty = True
    dropout = grad = True
    # The CUDA backward passes accumulate with atomics; dropout draws from torch's RNG.
    deterministic = False
    # SDPA multiplies hidden values by weight 0 (0 * NaN = NaN): dispatch checks.
    finite_inputs_only = True
    priority = 100

    @classmethod
    def check_available(cls) -> str | None:
        return torch_unavailable()

    @classmethod
    def not_supported_reasons(cls, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs) + bias_reasons(inputs)
        if inputs.requires_grad and (inputs.q_len == 0 or inputs.kv_len == 0):
            reasons.append(f"gradients of an empty call (Lq={inputs.q_len}, "
                           f"Lk={inputs.kv_len}): its zeros would carry none")
        return reasons

    @classmethod
    def dispatch_reasons(cls, inputs: AttentionInputs) -> list[str]:
        """Gradients the flash backward gives in less time or memory (see the
        module's docstring); named, the kernel runs them."""
        why = _dense_grad_reason(inputs) if inputs.requires_grad else None
        return [] if why is None else [why]

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        return sdpa_attention(inputs), None, None


def _builds_dense_mask(inputs: AttentionInputs) -> bool:
    """Whether SDPA would get a ``(Lq, Lk)`` mask made here from a structured mask
    (a dense mask or a bias given by the caller is there already)."""
    return ("dense" not in inputs.mask_kinds and restricts(inputs)
            and structured_form(inputs) is None)


def _dense_grad_reason(inputs: AttentionInputs) -> str | None:
    """Why the flash backward should take this call instead, or None."""
    if not _builds_dense_mask(inputs):
        return None
    scores = inputs.q_len * inputs.kv_len
    band = band_of(inputs)
    windowed = band is not None and band.lower is not None
    if windowed and scores > DENSE_GRAD_SCORES_WINDOW:
        return (f"gradients through a sliding window as a dense {inputs.q_len}x"
                f"{inputs.kv_len} mask (the flash backward skips the tiles outside it)")
    if scores > DENSE_GRAD_SCORES:
        return (f"gradients through a dense {inputs.q_len}x{inputs.kv_len} mask "
                f"(> {DENSE_GRAD_SCORES} scores; the flash backward keeps O(L) memory)")
    return None


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
    if scores_may_overflow(inputs):
        # In float32 torch's kernel gives such a row NaN, as every kernel does.
        wide = inputs._replace(query=q.float(), key=k.float(), value=inputs.value.float(),
                               dtype="float32")
        return sdpa_attention(wide).to(q.dtype)
    if (inputs.mask is None and inputs.bias is None and len(batch) == 1
            and not needs_mask_tensor(inputs)):
        # The common call, kept as short as calling SDPA directly.
        return sdpa(q, k, v, dropout_p=inputs.dropout_p, scale=inputs.scale, enable_gqa=gqa)
    spec = sdpa_mask(inputs)
    attn_mask = spec.attn_mask
    if len(batch) != 1:
        q, k, v = (as_4d(x, batch) for x in (q, k, v))
        if isinstance(attn_mask, torch.Tensor):
            attn_mask = as_4d(attn_mask, batch)
    # Nothing checks the output where no value can be read: keep the rule here, for a
    # call whose mask can hide anything (unless the caller vouches for the inputs).
    guard = not (inputs.values_readable or inputs.assume_finite) and (
        attn_mask is not None or spec.is_causal)
    if guard:
        k, v, bad = clear_keys(inputs.xp, k, v)
    out = sdpa(q, k, v, attn_mask=attn_mask, dropout_p=inputs.dropout_p,
               is_causal=spec.is_causal, scale=inputs.scale, enable_gqa=gqa)
    if guard:
        out = poison(inputs.xp, out, rows_seeing(bad, attn_mask, spec.is_causal, inputs.q_len,
                                      inputs.group_size, q.dtype))
    if len(batch) != 1:
        out = out.reshape(*batch, *out.shape[1:])
    if spec.keep is not None:
        out = torch.where(spec.keep, out, 0.0)
    return out
