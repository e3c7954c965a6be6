"""The rule for non-finite inputs where nothing can check SDPA's output.

SDPA gives a key its mask hides weight 0, but ``0 * NaN`` is NaN, so a NaN or inf
value there reaches the row; kernels that add the mask to the scores let a hidden NaN
key through too. On the CPU dispatch sums the output and runs a call that fails
elsewhere (``finite_inputs_only``). Where the values cannot be read on the host (an
accelerator, where it would be a sync per call, or ``torch.compile``), the call is made
safe on the device instead, without reading anything, with :mod:`portattn.nonfinite`:

- every key whose key or value row is not finite becomes 0 in both, so a hidden one
  changes nothing (``clear_keys``);
- the rows the mask lets see such a key are multiplied by NaN afterwards (``poison``):
  their output is NaN, as the rule says, and so are their gradients, as the chain
  rule through a NaN makes them.

Which rows those are is read here from the mask arguments SDPA is given
(:func:`rows_seeing`), not from the structured mask as ``portattn.nonfinite`` does: a
bias's ``-inf`` hides keys too, and ``is_causal`` or torch's causal bias come with no
mask tensor.

It costs a pass to find such rows and a copy of the keys and values per call,
O((Lq + Lk) * D) next to the attention's O(Lq * Lk * D), plus, with a mask tensor, a
product of the mask with one column per head.
"""

from __future__ import annotations

from typing import Any


def rows_seeing(bad: Any, attn_mask: Any, is_causal: bool, q_len: int, group: int,
                dtype: Any) -> Any:
    """Boolean ``(B, Hq, Lq|1)``: the rows that SDPA's mask arguments let attend a key
    ``bad`` marks (``(B, Hkv, Lk)``; ``group`` query heads per key head); one row
    stands for all where the mask is the same for every row (key lengths)."""
    import torch
    from torch.nn.attention.bias import CausalBias

    lk = bad.shape[-1]
    if is_causal or isinstance(attn_mask, CausalBias):
        # Row i sees keys [0, min(i + 1 + offset, Lk)): those past the first bad key see
        # one. (Top-left rows past the last key see every key, and no bad one if none is.)
        offset = 0 if is_causal else lk - q_len
        positions = torch.arange(lk, device=bad.device)
        first = torch.where(bad, positions, lk).amin(dim=-1, keepdim=True)
        if group > 1:
            first = first.repeat_interleave(group, dim=1)
        ends = torch.arange(1 + offset, q_len + 1 + offset, device=bad.device).clamp(max=lk)
        return ends > first
    if group > 1:
        bad = bad.repeat_interleave(group, dim=1)
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")
    allowed = allowed.expand(*allowed.shape[:-1], lk)  # query lengths give (.., Lq, 1)
    # (.., Lq, Lk) @ (B, Hq, Lk, 1): a count of the bad keys each row may attend; a sum
    # of zeros and ones is 0 exactly when every term is, in any float dtype.
    seen = torch.matmul(allowed.to(dtype), bad.to(dtype)[..., None])
    return seen[..., 0] > 0
