"""The rule for non-finite inputs around flex_attention.

flex, like SDPA, multiplies a value its mask hides in a partial tile by weight 0, and
``0 * NaN`` is NaN. torch's CPU flex (seen in 2.13) also loses NaN scores: its row
maximum skips them and its vectorised exponential turns them into finite numbers, so
a row with a NaN query comes out 0 and a row that attends a NaN key can come out
finite; a score that overflows does the same. So:

- on the CPU, a call whose values can be read is checked first (the largest
  magnitude of the query, key and value, one reduction each, and of the bias and the
  ALiBi slopes): with a NaN or inf, or scores that could overflow float32
  (``max|q| * max|k| * D * |scale|``, or the softcap, plus what the bias and ALiBi
  add), the portable flash kernel, which keeps the rule, computes it instead. Under
  torch.compile, where nothing can be read, it always does.
- on CUDA nothing is read (a host sync per call): every key whose key or value is not
  finite is set to 0 and its score gets NaN through ``score_mod``, before the mask, so
  the mask hides it or lets it reach its row, which becomes NaN (Triton's exponential
  keeps NaN).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from portattn.nonfinite import clear_keys

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["bad_key_scores", "portable_instead"]

#: float32's largest value: flex sums scores in float32 whatever the inputs' dtype.
FLOAT32_MAX = 3.4028234663852886e38


def portable_instead(inputs: AttentionInputs) -> bool:
    """Whether a CPU call must run on the portable kernel to keep the rule."""
    if inputs.device != "cpu":
        return False
    if not inputs.values_readable:
        return True
    if not inputs.q_len or not inputs.kv_len:
        return False  # nothing to compute: zeros and -inf
    import torch

    with torch.no_grad():
        largest = torch.stack([torch.linalg.vector_norm(x.float(), ord=math.inf)
                               for x in (inputs.query, inputs.key, inputs.value)])
        bias_high = 0.0
        if inputs.bias is not None:
            bias_high = float(torch.where(torch.isneginf(inputs.bias), 0.0,
                                          inputs.bias.float()).amax().clamp(min=0))
        q_max, k_max, v_max = (float(x) for x in largest)  # one sync: NaN stays NaN
        # ALiBi adds up to max|slope| times the largest distance, max(Lq, Lk)
        alibi_high = 0.0
        if inputs.alibi_slopes is not None:
            alibi_high = float(torch.linalg.vector_norm(inputs.alibi_slopes.float(),
                                                        ord=math.inf)) * max(
                inputs.q_len, inputs.kv_len)
    if not all(map(math.isfinite, (q_max, k_max, v_max, bias_high, alibi_high))):
        return True
    # softcap bounds the product's share of the scores
    product = (abs(inputs.softcap) if inputs.softcap is not None
               else q_max * k_max * inputs.head_dim * abs(inputs.scale))
    bound = product + bias_high + alibi_high
    return not bound < FLOAT32_MAX


def bad_key_scores(inputs: AttentionInputs, key: Any, value: Any) -> tuple[Any, Any, Any]:
    """``(key, value, scores)``: 4-D keys and values with every row that holds a NaN
    or inf set to 0 in both, and ``(B, Hq, Lk)`` float32 scores to add, NaN on those
    rows and 0 elsewhere (see :func:`~portattn_torch._flex_mods.score_mod_of`)."""
    import torch

    key, value, bad = clear_keys(inputs.xp, key, value)
    if inputs.group_size > 1:
        bad = bad.repeat_interleave(inputs.group_size, dim=1)
    return key, value, torch.where(bad, math.nan, 0.0).to(torch.float32)
