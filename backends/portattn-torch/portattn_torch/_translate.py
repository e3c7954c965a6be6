"""portattn's semantics expressed as ``torch.nn.functional.scaled_dot_product_attention``.

SDPA takes one mask (boolean or additive float) or ``is_causal`` (top-left), never
both, so the cheapest exact form is chosen per call:

- no mask and no bias: nothing, so SDPA may pick its fastest kernel;
- a single top-left causal mask (or bottom-right with ``Lq == Lk``): ``is_causal``;
- a single bottom-right causal mask with ``Lq < Lk`` on an accelerator: torch's
  lower-right causal bias, which its fused kernels apply without a mask tensor;
- anything else: one boolean mask (float when there is a bias) built on the device,
  broadcast rather than expanded to ``(..., Hq, Lq, Lk)``. Calls on the CPU with
  fewer than :data:`CPU_MASKLESS_MIN_KEYS` keys get one too, even all true: without
  a mask tensor torch's CPU kernel gives 0 instead of NaN there for a row with a NaN
  query or overflowing scores.

Rows that the mask leaves no key are given every key instead (so no SDPA backend
sees a row of ``-inf``, which some turn into NaN in the output or the gradient) and
zeroed afterwards: ``keep`` says which rows are real.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from portattn.masks import POSITIONAL

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs
    from portattn.masks import Band


@dataclass(frozen=True)
class SDPAMask:
    """The mask arguments of one SDPA call."""

    attn_mask: Any = None
    is_causal: bool = False
    keep: Any = None
    """Boolean ``(..., Lq, 1)``, False on fully masked rows; None when there are none."""


#: Below this many keys, torch's CPU kernel (seen in torch 2.13) without a mask tensor
#: gives 0 for the row of a NaN query or of float32 scores that overflow; given any
#: boolean mask it keeps the NaN.
CPU_MASKLESS_MIN_KEYS = 16


def needs_mask_tensor(inputs: AttentionInputs) -> bool:
    """Whether SDPA must be given a mask tensor even where the mask excludes nothing
    (see :data:`CPU_MASKLESS_MIN_KEYS`)."""
    return inputs.kv_len < CPU_MASKLESS_MIN_KEYS and inputs.device == "cpu"


#: bfloat16 has float32's exponent range, so its scores can overflow the float32 they
#: are summed in; torch's CPU kernel (seen in torch 2.13) then gives 0 for the row.
FLOAT32_MAX = 3.4028234663852886e38


def scores_may_overflow(inputs: AttentionInputs) -> bool:
    """Whether a bfloat16 call on the CPU could have a score (with its bias) beyond
    float32: ``|q . k| * scale <= D * max|q| * max|k| * |scale|`` bounds it, from one
    min/max reduction over the queries and one over the keys. NaN inputs count too.
    Under ``torch.compile`` no value can be read: False."""
    if (inputs.dtype != "bfloat16" or inputs.device != "cpu" or not inputs.query.numel()
            or not inputs.key.numel()):
        return False
    import torch

    if torch.compiler.is_compiling():
        return False
    # read without the autograd record: these values are no part of the result
    ends = [*torch.aminmax(inputs.query.detach()), *torch.aminmax(inputs.key.detach())]
    if inputs.bias is not None and inputs.bias.numel():
        ends.append(inputs.bias.detach().amax().clamp(min=0))
    ends = [float(x) for x in ends]
    if not all(map(math.isfinite, ends)):
        return True
    q_min, q_max, k_min, k_max, *bias_max = ends
    bound = (max(-q_min, q_max) * max(-k_min, k_max) * inputs.head_dim
             * abs(inputs.scale) + sum(bias_max))
    return not bound < FLOAT32_MAX


def band_of(inputs: AttentionInputs) -> Band | None:
    """The mask's causal and sliding-window parts as one band, None when they exclude
    nothing (no such part, or windows wider than the call)."""
    band = None if inputs.mask is None else inputs.mask.band(inputs.q_len, inputs.kv_len)
    if band is None:
        return None
    band = band.normalized(inputs.q_len, inputs.kv_len)
    return None if band.lower is None and band.upper is None else band


def restricts(inputs: AttentionInputs) -> bool:
    """Whether the mask excludes anything at all (known from its structure)."""
    return band_of(inputs) is not None or bool(_array_kinds(inputs))


def _array_kinds(inputs: AttentionInputs) -> frozenset[str]:
    return inputs.mask_kinds - POSITIONAL


_HALF = ("float16", "bfloat16")


def bias_reasons(inputs: AttentionInputs) -> list[str]:
    """Why SDPA cannot add ``inputs.bias`` exactly: half-precision inputs must see the
    bias as given (in float32). torch's CPU kernels take a float32 mask with half
    inputs and accumulate in float32; its fused CUDA kernels want the query's dtype."""
    bias = inputs.bias
    if bias is None or inputs.dtype not in _HALF or inputs.device == "cpu":
        return []
    name = str(bias.dtype).rsplit(".", 1)[-1]
    if name == inputs.dtype:
        return []
    return [f"bias dtype={name} with dtype={inputs.dtype} on {inputs.device} "
            "(SDPA would round the bias to the query's dtype)"]


def _mask_dtype(inputs: AttentionInputs) -> Any:
    """The float mask's dtype: the query's, or float32 for half inputs whose bias has
    another dtype (rounding it to half would change the scores)."""
    import torch

    query, bias = inputs.query, inputs.bias
    if inputs.dtype in _HALF and bias.dtype != query.dtype:
        return torch.float32
    return query.dtype


def sdpa_mask(inputs: AttentionInputs) -> SDPAMask:
    """SDPA's ``attn_mask``/``is_causal`` for ``inputs`` (requires ``Lq, Lk > 0``)."""
    form = structured_form(inputs)
    return form if form is not None else _dense_mask(inputs)


def structured_form(inputs: AttentionInputs) -> SDPAMask | None:
    """SDPA's mask arguments when no mask tensor has to be built here, else None."""
    band = band_of(inputs)
    lq, lk = inputs.q_len, inputs.kv_len
    if inputs.bias is not None or _array_kinds(inputs) or needs_mask_tensor(inputs):
        return None
    if band is None:
        return SDPAMask()
    # A band open to the left is causal with query 0 at position band.upper. SDPA's
    # causal forms place it at 0 (is_causal) or Lk - Lq (the lower-right bias); a mask
    # cut by restrict() may sit elsewhere: dense then. torch's CPU flash kernel gives
    # NaN under is_causal with a scale <= 0.
    if band.lower is not None or inputs.scale <= 0:
        return None
    if band.upper == 0:
        # Top-left causal leaves every row at least key 0: no empty rows.
        return SDPAMask(is_causal=True)
    if (band.upper == lk - lq and lq < lk and inputs.device != "cpu"
            and inputs.num_heads == inputs.num_kv_heads):
        # Lq < Lk leaves no row empty. torch applies this bias inside its fused CUDA
        # kernels (on CPU it would only build the same boolean mask we build below);
        # its fused path ignores enable_gqa, hence equal head counts only.
        from torch.nn.attention.bias import causal_lower_right

        return SDPAMask(attn_mask=causal_lower_right(lq, lk))
    return None


def _dense_mask(inputs: AttentionInputs) -> SDPAMask:
    import torch

    lq, lk = inputs.q_len, inputs.kv_len
    allowed = None  # None: the mask excludes nothing
    if restricts(inputs):
        allowed = inputs.mask.tile(inputs.xp, 0, lq, 0, lk, lq, lk, inputs.device_obj)
    if inputs.bias is None:
        if allowed is None:  # a mask tensor only for torch's sake: no row is empty
            return SDPAMask(attn_mask=torch.ones((lq, lk), dtype=torch.bool,
                                                 device=inputs.device_obj))
        keep = allowed.any(dim=-1, keepdim=True)
        return SDPAMask(attn_mask=_along_keys(allowed | ~keep, inputs), keep=keep)
    # Masked pairs become -inf in the float mask.
    bias = inputs.bias.to(_mask_dtype(inputs))
    if allowed is not None:
        bias = torch.where(allowed, bias, -math.inf)
    keep = (bias != -math.inf).any(dim=-1, keepdim=True)
    return SDPAMask(attn_mask=_along_keys(torch.where(keep, bias, 0.0), inputs), keep=keep)


def _along_keys(mask: Any, inputs: AttentionInputs) -> Any:
    """``mask`` with its key dim written out off the CPU: torch's CUDA efficient kernel
    reads it with stride 1 and refuses one broadcast along the keys (a query-only mask,
    a bias of shape ``(..., Lq, 1)``); elsewhere it stays broadcast."""
    lk = inputs.kv_len
    if inputs.device == "cpu" or (mask.shape[-1] == lk and mask.stride(-1) == 1):
        return mask
    return mask.expand(*mask.shape[:-1], lk).contiguous()


def as_4d(x: Any, batch_shape: tuple[int, ...]) -> Any:
    """``(*batch, a, b, c) -> (prod(batch) or 1, a, b, c)``: SDPA's fused kernels take
    exactly one batch dim. 2-D masks broadcast as they are."""
    if x.ndim == 2 or len(batch_shape) == 1:
        return x
    lead, tail = tuple(x.shape[:-3]), tuple(x.shape[-3:])
    if all(n == 1 for n in lead):
        return x.reshape(1, *tail)
    return x.expand(*batch_shape, *tail).reshape(math.prod(batch_shape), *tail)
