"""Launching split-KV decode (see :mod:`._triton_decode`) on ``(Z, H, L, D)`` views.

:func:`flash_forward` takes this path by shape (:func:`~portattn_triton.pick_path`:
few queries whose rows per K/V head fit one tile); ``flash_forward(..., path="decode",
config=Config(...))`` runs it with fixed block sizes, and ``decode_forward``'s
``num_splits`` fixes the number of key slices.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._configs import (
    Config,
    block_dim,
    decode_config,
    decode_max_rows,
    decode_splits,
    is_even,
    merge_warps,
)
from ._distance import check_tiles

if TYPE_CHECKING:
    from ._plan import MaskPlan

__all__ = ["decode_forward"]


def decode_forward(q: Any, k: Any, v: Any, scale: float, softcap: float | None,
                   plan: MaskPlan, poison: Any, capability: tuple[int, int] | None,
                   config: Config | None = None,
                   num_splits: int | None = None) -> tuple[Any, Any]:
    """``(out (Z, Hq, Lq, Dv), lse (Z, Hq, Lq) float32)``; two launches: the splits
    (each reading its row of the block form), then their merge."""
    import torch

    z, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    rows = group * lq
    limit = decode_max_rows(q.element_size(), max(block_dim(d), block_dim(dv)))
    if rows > limit:
        msg = (f"decode packs at most {limit} query rows per K/V head at this dtype and "
               f"head dim; got {group} heads x {lq} queries")
        raise ValueError(msg)
    if config is None:
        config = decode_config(capability, q.element_size(), d, dv, rows, plan.extra)
    if config.block_m < rows:
        msg = f"config.block_m={config.block_m} < {rows} packed query rows"
        raise ValueError(msg)
    if plan.distance is not None:
        check_tiles(config.block_m, config.block_n)
    dev = q.device
    if num_splits is None:
        sms = (torch.cuda.get_device_properties(dev).multi_processor_count
               if dev.type == "cuda" else None)
        num_splits = decode_splits(z * hkv, lk, config.block_n, sms)
    # Every split the same whole number of key blocks long.
    split_len = math.ceil(math.ceil(lk / num_splits) / config.block_n) * config.block_n
    num_splits = math.ceil(lk / split_len)
    bdv = block_dim(dv)
    part_out = torch.empty((z * hkv, num_splits, config.block_m, bdv), dtype=torch.float32,
                           device=dev)
    part_lse = torch.empty((z * hkv, num_splits, config.block_m), dtype=torch.float32,
                           device=dev)
    out = torch.empty((z, hq, lq, dv), dtype=q.dtype, device=dev)
    lse = torch.empty((z, hq, lq), dtype=torch.float32, device=dev)
    dummy = part_lse  # stands in for absent optional tensors; never read

    from ._launching import bias_strides, on_device, precision
    from ._triton_decode import decode_merge_kernel, decode_split_kernel

    lower, upper = plan.band
    kl, ql, bias = plan.key_lengths, plan.query_lengths, plan.bias
    distance = None if plan.distance is None else plan.distance.values
    (table, *table_args), bits, has_bits = plan.decode_tables(
        config.block_m, config.block_n, num_splits, split_len // config.block_n)
    with on_device(dev):
        decode_split_kernel[(z * hkv, num_splits)](
            q, k, v, part_out, part_lse,
            *(dummy if t is None else t for t in (kl, ql, poison)), table, bits,
            dummy if bias is None else bias, dummy if distance is None else distance,
            *q.stride(), *k.stride(), *v.stride(), *bias_strides(bias), *table_args,
            hkv, group, lq, lk, d, dv, scale,
            1.0 if softcap is None else float(softcap),
            0 if lower is None else lower, 0 if upper is None else upper,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_dim(d),
            BLOCK_DV=bdv, EVEN_D=is_even(d, dv), HAS_LOWER=lower is not None,
            HAS_UPPER=upper is not None, HAS_KEY_LENGTHS=kl is not None,
            HAS_QUERY_LENGTHS=ql is not None, HAS_POISON=poison is not None,
            HAS_BITS=has_bits, HAS_BIAS=bias is not None, HAS_DISTANCE=distance is not None,
            SOFTCAP=softcap is not None, INPUT_PRECISION=precision(q.dtype),
            num_warps=config.num_warps, num_stages=config.num_stages)
        decode_merge_kernel[(z * hkv,)](
            part_out, part_lse, out, lse, *out.stride(), hkv, hq, group, lq, dv,
            num_splits, BLOCK_M=config.block_m, BLOCK_DV=bdv,
            num_warps=merge_warps(config.block_m, bdv))
    return out, lse
