"""Masks of every kind for the block-form tests, and the float64 reference they meet.

Each builder takes the call's shape and returns a mask on CPU torch tensors; the same
mask object goes to the kernel and to portattn's ``reference`` kernel (float64 torch,
differentiable), so the oracle sees exactly the pairs the kernel must.
"""

from __future__ import annotations

import torch

import portattn
from portattn import masks


def _ids(batch, length, sizes, seed=0):
    """Segment ids ``(*batch, length)``: documents of the given sizes, shuffled per
    batch element, the rest padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(int(torch.tensor(batch).prod())):
        order = torch.randperm(len(sizes), generator=gen).tolist()
        ids = torch.cat([torch.full((sizes[i],), i) for i in order])
        pad = torch.full((max(0, length - len(ids)),), -1)
        rows.append(torch.cat([ids, pad])[:length])
    return torch.stack(rows).reshape(*batch, length)


def _per_batch(batch, values):
    n = int(torch.tensor(batch).prod())
    return torch.tensor([values[i % len(values)] for i in range(n)]).reshape(batch)


def _layout(heads, lk, block, seed=3):
    gen = torch.Generator().manual_seed(seed)
    rows = cols = -(-lk // block)
    return torch.rand(heads, rows, cols, generator=gen) < 0.4


def _strided(b, h, q, k):
    return ((q - k) % (h + 2) == 0) | (k < 3 + 4 * b)


#: name -> builder(batch, hq, lq, lk) -> mask
MASKS = {
    "documents": lambda batch, hq, lq, lk: masks.documents(
        _ids(batch, lq, (23, 9, 30)), _ids(batch, lk, (23, 9, 30))),
    "causal_documents": lambda batch, hq, lq, lk: masks.causal() & masks.documents(
        _ids(batch, lq, (17, 40, 5)), _ids(batch, lk, (17, 40, 5))),
    "global_window": lambda batch, hq, lq, lk: masks.sliding_window(6, 6)
    | masks.global_tokens(torch.tensor([0, 37])),
    "sinks_window_causal": lambda batch, hq, lq, lk: masks.causal()
    & (masks.sliding_window(9) | masks.sink_tokens(4)),
    "prefix_lm": lambda batch, hq, lq, lk: masks.causal()
    | masks.prefix(_per_batch(batch, (25, 0, 60))),
    "chunks_causal": lambda batch, hq, lq, lk: masks.causal() & masks.chunks(24),
    "block_layout_per_head": lambda batch, hq, lq, lk: masks.block_layout(
        _layout(hq, lk, 16), 16),
    "function_per_batch_and_head": lambda batch, hq, lq, lk: masks.function(_strided),
    "dense": lambda batch, hq, lq, lk: masks.dense(
        torch.rand(*batch, hq, lq, lk, generator=torch.Generator().manual_seed(5)) < 0.3),
    "key_ranges_causal": lambda batch, hq, lq, lk: masks.causal() & masks.key_ranges(
        _per_batch(batch, (5, 30)), _per_batch(batch, (lk, lk - 11))),
    "sequence_window": lambda batch, hq, lq, lk: masks.sequence_window(
        7, 0, query_lengths=_per_batch(batch, (lq, lq // 2)),
        key_lengths=_per_batch(batch, (lk - 3, lk))),
}


def inputs(dtype, batch, hq, hkv, lq, lk, d, dv=None, seed=0):
    """``(q, k, v)`` in ``dtype``, rounded from float64 draws."""
    gen = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    return tuple(torch.randn(*batch, h, n, e, generator=gen, dtype=torch.float64).to(dtype)
                 for h, n, e in ((hq, lq, d), (hkv, lk, d), (hkv, lk, dv)))


def reference(q, k, v, **kwargs):
    """``(out, lse)`` of portattn's reference kernel on float64 copies (differentiable
    when the inputs require gradients)."""
    return portattn.attention(q.double(), k.double(), v.double(), return_lse=True,
                              kernel="reference", **kwargs)


#: Ways to change a tensor in place: through torch, and around its version counter.
WRITES = {
    "copy_": lambda a, new: a.copy_(torch.as_tensor(new, dtype=a.dtype)),
    ".data": lambda a, new: a.data.copy_(torch.as_tensor(new, dtype=a.dtype)),
    ".numpy() view": lambda a, new: a.numpy().__setitem__(..., new),
    "DLPack": lambda a, new: torch.from_dlpack(a).copy_(torch.as_tensor(new, dtype=a.dtype)),
    "untyped_storage": lambda a, new: a.untyped_storage().copy_(
        torch.as_tensor(new, dtype=a.dtype).untyped_storage()),
    "torch.from_numpy(t.numpy())": lambda a, new: torch.from_numpy(a.numpy()).copy_(
        torch.as_tensor(new, dtype=a.dtype)),
}
