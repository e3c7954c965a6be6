"""The float64 oracle of the gradient tests: attention written out, for torch autograd."""

from __future__ import annotations

import math

import torch

#: Largest error allowed on a gradient, relative to its largest reference entry (at
#: least 1): the conformance kit's forward tolerances (measured here: 6e-7 and 6e-4).
GRAD_TOLERANCE = {"float32": 2e-5, "float16": 5e-3}


def textbook(q, k, v, scale, lower, upper, softcap, key_lengths, query_lengths):
    """``(out, lse)`` of masked softmax attention, written out; fully masked rows give
    0 and -inf with finite gradients (the masked branches are selected, not scaled)."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    lq, lk = s.shape[-2:]
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if lower is not None:
        keep &= j - i >= lower
    if upper is not None:
        keep &= j - i <= upper
    batch = q.shape[:-3]
    keep = keep.expand(*batch, 1, lq, lk)
    if key_lengths is not None:
        keep = keep & (j < key_lengths.reshape(*batch, 1, 1, 1))
    if query_lengths is not None:
        keep = keep & (i < query_lengths.reshape(*batch, 1, 1, 1))
    seen = keep.any(-1, keepdim=True)
    top = torch.where(seen, torch.where(keep, s, -math.inf).amax(-1, keepdim=True), 0.0)
    e = torch.where(keep, torch.exp(s - top), 0.0)
    total = torch.where(seen, e.sum(-1, keepdim=True), 1.0)
    lse = torch.where(seen, top + torch.log(total), -math.inf)
    return (e / total) @ v, lse.squeeze(-1)
