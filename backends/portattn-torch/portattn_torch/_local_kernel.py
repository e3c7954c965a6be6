"""The ``torch_sdpa_local`` kernel: a sliding window joined to global tokens
(``sliding_window(w) | global_tokens(positions)``, Longformer's and BigBird's local
pattern) on the CPU, in three exact parts merged by their log-sum-exps:

- the window: queries in chunks of :data:`CHUNK` rows, each chunk against the keys its
  rows' windows reach, through torch's CPU flash kernel with the chunk's band as a
  float mask (chunks at the same distance from the edges share it): about
  ``(CHUNK + w) / w`` times the window's pairs;
- the global keys: every row against the global tokens' keys its window does not
  already hold, a ``(Lq, n)`` product;
- the global rows: the global tokens' queries against every key, one flash call.

The window and global-key parts merge exactly (the split-KV identity of
:func:`portattn.merge`); the global rows then replace theirs. A spread of global tokens
reaches every query block of a tiled kernel's grid, so a block form visits far more
tiles than the pattern holds pairs (26% of the 128-tiles for 16 tokens and a window of
512 at L = 16384, against 3.3% of the pairs); here each part costs its own pairs.

The global positions are read on the host, so the kernel refuses calls whose values
cannot be read now (``torch.compile``). Forward and log-sum-exp only: calls that need
gradients go to other kernels.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from portattn import masks
from portattn.kernel import Kernel

from ._availability import aten_ops_missing, torch_unavailable
from ._translate import as_4d, scores_may_overflow

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

#: Query rows per window call: the window's width, within these bounds (at
#: (1, 8, 16384, 64) float32 with a window of 512 on one CPU thread, chunks of 512 rows
#: took 0.87x the time of chunks of 128, and chunks of 1024 1.9x).
CHUNK = (128, 512)

class TorchLocalKernel(Kernel):
    """A window with global tokens on the CPU: window, global keys and global rows."""

    name = "torch_sdpa_local"
    namespaces = frozenset({"torch"})
    devices = frozenset({"cpu"})
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})
    masks = frozenset({"sliding_window", "causal", "global_tokens", "union"})
    gqa = value_head_dim = empty = True
    returns_lse = True
    # torch's CPU flash kernel lets a hidden NaN through 0 * NaN; dispatch checks.
    finite_inputs_only = True
    priority = 120

    needs_global_tokens: ClassVar[bool] = True
    """Dispatch leaves masks without ``global_tokens`` to ``torch_sdpa`` and
    ``torch_flex`` (the kernel computes a window or causal band alone too, and no
    mask, and runs them when named)."""

    @classmethod
    def check_available(cls) -> str | None:
        return torch_unavailable() or aten_ops_missing(
            "_scaled_dot_product_flash_attention_for_cpu")

    @classmethod
    def not_supported_reasons(cls, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        why = _structure_reason(inputs.mask)
        if why is not None:
            reasons.append(why)
        if not inputs.values_readable:
            reasons.append("values not readable now (traced or compiled): the global "
                           "positions are read on the host")
        return reasons

    @classmethod
    def dispatch_reasons(cls, inputs: AttentionInputs) -> list[str]:
        split = masks.band_and_tokens(inputs.mask)
        if cls.needs_global_tokens and (split is None or split.tokens is None):
            return ["no global_tokens in the mask (torch_sdpa or torch_flex runs it)"]
        return []

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        out, lse = local_attention(inputs)
        return out, lse if inputs.return_lse else None, None



def _structure_reason(mask: Any) -> str | None:
    """Why the mask is not a window or causal band joined to global tokens (either
    may be missing)."""
    if masks.band_and_tokens(mask) is None:
        return ("mask is not a sliding window or causal band | global_tokens(positions) "
                "of this call")
    return None


def _band(inputs: AttentionInputs) -> tuple[Any, Any]:
    """``(band or None, global_tokens part or None)``; no mask is an unbounded band."""
    if inputs.mask is None:
        return masks.Band(None, None), None
    split = masks.band_and_tokens(inputs.mask)
    return split.key_band(inputs.q_len, inputs.kv_len), split.tokens


def local_attention(inputs: AttentionInputs) -> tuple[Any, Any]:
    """``(out, lse)`` of ``inputs``: window, global keys and global rows."""
    import numpy as np
    import torch

    batch = inputs.batch_shape
    lead = (*batch, inputs.num_heads, inputs.q_len)
    q, k, v = inputs.query, inputs.key, inputs.value
    dtype = q.dtype
    lse_dtype = torch.float32 if inputs.dtype in ("float16", "bfloat16") else dtype
    if inputs.q_len == 0 or inputs.kv_len == 0:
        out = torch.zeros((*lead, inputs.value_head_dim), dtype=dtype)
        return out, torch.full(lead, -math.inf, dtype=lse_dtype)
    if scores_may_overflow(inputs):  # bfloat16 scores beyond float32: run in float32
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = (as_4d(x, batch) for x in (q, k, v))
    d, dv = inputs.head_dim, inputs.value_head_dim
    if d < dv:  # torch's kernel wants one head size: zeros change no score
        q, k = (torch.nn.functional.pad(x, (0, dv - d)) for x in (q, k))
    elif dv < d:
        v = torch.nn.functional.pad(v, (0, d - dv))
    band, tokens = _band(inputs)
    lq, lk = inputs.q_len, inputs.kv_len
    out, lse = _window(q, k, v, band, inputs.scale, lse_dtype)
    if tokens is None:
        return out[..., :dv].reshape(*lead, dv).to(dtype), lse.reshape(lead)
    host = tokens.positions_on_host()
    positions = np.asarray(host, dtype=np.int64).reshape(-1, host.shape[-1])
    rows = q.shape[0]
    groups = ([(slice(None), positions[0])] if len(positions) == 1
              else [(slice(b, b + 1), positions[b]) for b in range(rows)])
    offset = lk - lq
    for where, chosen in groups:
        chosen = np.unique(chosen[chosen >= 0])
        keys = chosen[chosen < lk]
        if keys.size:
            o, m = _global_keys(q[where], k[where], v[where], keys, band, inputs.scale,
                                lse_dtype)
            out[where], lse[where] = _merged(out[where], lse[where], o, m)
        queries = chosen - offset
        queries = queries[(queries >= 0) & (queries < lq)]
        if queries.size:
            index = torch.from_numpy(queries)
            o, m = _flash(q[where][:, :, index], k[where], v[where], inputs.scale)
            out[where] = out[where].index_copy(2, index, o)
            lse[where] = lse[where].index_copy(2, index, m.to(lse_dtype))
    out = out[..., :dv].reshape(*lead, dv).to(dtype)
    return out, lse.reshape(lead)


def _flash(q: Any, k: Any, v: Any, scale: float, mask: Any = None) -> tuple[Any, Any]:
    import torch

    if mask is None and k.shape[2] < 16:
        # below 16 keys torch's kernel without a mask gives 0 for a NaN query's row
        mask = torch.zeros((q.shape[2], k.shape[2]), dtype=q.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale)


def _window(q: Any, k: Any, v: Any, band: Any, scale: float,
            lse_dtype: Any) -> tuple[Any, Any]:
    """The window part: ``(out, lse)`` with ``lse = -inf`` on rows it leaves no key."""
    import torch

    rows, heads, lq, width = q.shape
    lk = k.shape[2]
    out = torch.zeros((rows, heads, lq, width), dtype=q.dtype)
    lse = torch.full((rows, heads, lq), -math.inf, dtype=lse_dtype)
    if band is None or band.empty:
        return out, lse
    lower, upper = band.lower, band.upper
    first = 0 if upper is None else max(0, -upper)
    last = lq if lower is None else min(lq, lk - lower)
    low, high = CHUNK
    chunk = high if lower is None or upper is None else min(high, max(low, upper - lower + 1))
    bands: dict[tuple[int, int, int], Any] = {}  # float masks, by the chunk's shape
    for q0 in range(first, last, chunk):
        q1 = min(q0 + chunk, last)
        k0 = 0 if lower is None else max(0, q0 + lower)
        k1 = lk if upper is None else min(lk, q1 + upper)
        key = (k0 - q0, q1 - q0, k1 - k0)
        if key not in bands:
            diff = (torch.arange(k0, k1)[None, :] - torch.arange(q0, q1)[:, None])
            hidden = torch.zeros(diff.shape, dtype=torch.bool)
            if lower is not None:
                hidden |= diff < lower
            if upper is not None:
                hidden |= diff > upper
            bands[key] = torch.zeros(diff.shape, dtype=q.dtype).masked_fill(hidden, -math.inf)
        o, m = _flash(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], scale, bands[key])
        out[:, :, q0:q1] = o
        lse[:, :, q0:q1] = m
    return out, lse


def _global_keys(q: Any, k: Any, v: Any, keys: Any, band: Any, scale: float,
                 lse_dtype: Any) -> tuple[Any, Any]:
    """Every row against the global keys outside its window: ``(out, lse)``."""
    import torch

    index = torch.from_numpy(keys)
    group = q.shape[1] // k.shape[1]
    compute = lse_dtype
    kg = k[:, :, index].repeat_interleave(group, dim=1).to(compute)
    vg = v[:, :, index].repeat_interleave(group, dim=1).to(compute)
    scores = torch.matmul(q.to(compute), kg.transpose(-1, -2)) * scale
    if band is not None:
        diff = index[None, :] - torch.arange(q.shape[2])[:, None]
        inside = torch.ones(diff.shape, dtype=torch.bool)
        if band.lower is not None:
            inside &= diff >= band.lower
        if band.upper is not None:
            inside &= diff <= band.upper
        scores = scores.masked_fill(inside, -math.inf)  # the window holds these pairs
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    weights = torch.exp(scores - torch.where(seen, lse, 0.0)[..., None])
    out = torch.matmul(weights, vg)
    return out, lse


def _merged(out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """Attention over two disjoint key sets, joined exactly by their lse."""
    import torch

    lse = torch.logaddexp(lse_a, lse_b)
    seen = torch.isfinite(lse)
    safe = torch.where(seen, lse, 0.0)
    wa = torch.where(seen, torch.exp(lse_a - safe), 0.0)[..., None]
    wb = torch.where(seen, torch.exp(lse_b - safe), 0.0)[..., None]
    out = out_a.to(out_b.dtype) * wa + out_b * wb
    return out.to(out_a.dtype), lse.to(lse_a.dtype)
