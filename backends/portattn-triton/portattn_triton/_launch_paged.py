"""Launching split-KV decode over paged keys (:mod:`._triton_paged`) for a call of
:func:`portattn.paged_attention` on torch: the splits, their merge
(:func:`~._triton_decode.decode_merge_kernel`, over a padded ``(S, Hq, Qmax, Dv)``
output), then the packed rows taken from it and the sinks joined."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from ._configs import block_dim, decode_max_rows, decode_splits, paged_config

if TYPE_CHECKING:
    from portattn.kernel import PagedInputs

__all__ = ["paged_forward", "paged_rows_limit"]


def paged_rows_limit(call: PagedInputs) -> int:
    """The most packed rows (query heads of a group times a sequence's queries) one
    program's tile holds at this dtype and head dim."""
    dims = max(block_dim(call.query.shape[2]), block_dim(call.value_pages.shape[-1]))
    return decode_max_rows(2 if call.dtype in ("float16", "bfloat16") else 4, dims)


def paged_forward(call: PagedInputs, num_splits: int | None = None) -> tuple[Any, Any]:
    """``(out (T, Hq, Dv), lse (Hq, T) float32)`` of the paged call ``call`` (torch
    tensors on the pools' device); ``num_splits`` fixes the slices of the keys (None:
    about two programs per multiprocessor)."""
    import torch

    from ._launching import on_device, precision
    from ._triton_decode import decode_merge_kernel
    from ._triton_paged import paged_split_kernel

    q, k_pool, v_pool = call.query, call.key_pages, call.value_pages
    total, hq, d = q.shape
    dv, hkv, page = v_pool.shape[-1], call.num_kv_heads, call.page_size
    group, sequences = hq // hkv, len(call.key_lengths)
    counts = [b - a for a, b in pairwise(call.query_starts)]
    most = max(counts, default=0)
    dev = q.device
    if total == 0 or most == 0:
        return (torch.zeros((total, hq, dv), dtype=q.dtype, device=dev),
                torch.zeros((hq, total), dtype=torch.float32, device=dev))
    config = paged_config(q.element_size(), d, dv, group * most)
    longest = max(call.key_lengths)
    if num_splits is None:
        sms = (torch.cuda.get_device_properties(dev).multi_processor_count
               if dev.type == "cuda" else None)
        num_splits = decode_splits(sequences * hkv, longest, config.block_n, sms)
    # every split the same whole number of key blocks long
    split_len = math.ceil(math.ceil(max(longest, 1) / num_splits) / config.block_n) \
        * config.block_n
    num_splits = max(1, math.ceil(longest / split_len))
    bdv = block_dim(dv)
    part_out = torch.empty((sequences * hkv, num_splits, config.block_m, bdv),
                           dtype=torch.float32, device=dev)
    part_lse = torch.empty((sequences * hkv, num_splits, config.block_m),
                           dtype=torch.float32, device=dev)
    padded = torch.empty((sequences, hq, most, dv), dtype=q.dtype, device=dev)
    padded_lse = torch.empty((sequences, hq, most), dtype=torch.float32, device=dev)
    band = None if call.mask is None else call.mask.band(0, 0)
    lower, upper = (None, None) if band is None else (band.lower, band.upper)

    def pool_strides(pool: Any) -> tuple[int, ...]:  # (page, row, head, dim)
        s = pool.stride()
        return (s[0], s[2], s[1], s[3]) if call.head_major else s

    ints = {"dtype": torch.int32, "device": dev}
    starts = torch.tensor(call.query_starts, **ints)
    lengths = torch.tensor(call.key_lengths, **ints)
    table = call.block_table.to(torch.int32).contiguous()
    slopes = None if call.alibi_slopes is None else call.alibi_slopes.to(torch.float32)
    with on_device(dev):
        paged_split_kernel[(sequences * hkv, num_splits)](
            q, k_pool, v_pool, part_out, part_lse, table, starts, lengths,
            part_lse if slopes is None else slopes,
            *q.stride(), *pool_strides(k_pool), *pool_strides(v_pool), table.stride(0),
            0 if slopes is None else slopes.stride(0),
            hkv, group, most, page, split_len, d, dv, call.scale,
            1.0 if call.softcap is None else call.softcap,
            0 if lower is None else lower, 0 if upper is None else upper,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_dim(d),
            BLOCK_DV=bdv, HAS_LOWER=lower is not None, HAS_UPPER=upper is not None,
            HAS_ALIBI=slopes is not None, SOFTCAP=call.softcap is not None,
            INPUT_PRECISION=precision(q.dtype), num_warps=config.num_warps,
            num_stages=config.num_stages)
        decode_merge_kernel[(sequences * hkv,)](
            part_out, part_lse, padded, padded_lse, *padded.stride(), hkv, hq, group, most,
            dv, num_splits, BLOCK_M=config.block_m, BLOCK_DV=bdv,
            BLOCK_S=max(2, 1 << (num_splits - 1).bit_length()), num_warps=4)
    # packed query t is query i of sequence s: row (s, :, i) of the padded result
    seq = torch.repeat_interleave(torch.arange(sequences, device=dev),
                                  torch.tensor(counts, device=dev))
    index = torch.arange(total, device=dev) - starts.to(torch.int64)[seq]
    out, lse = padded[seq, :, index], padded_lse[seq, :, index]  # (T, Hq, Dv), (T, Hq)
    if call.sinks is not None:  # each row's denominator gains exp(sink)
        sink = call.sinks.to(torch.float32)[seq]
        joined = torch.logaddexp(lse, sink)
        out = (out.to(torch.float32) * torch.exp(lse - joined)[..., None]).to(q.dtype)
        lse = joined
    return out, lse.transpose(0, 1)
