"""Launching paged attention (:mod:`._triton_paged`) for a call of
:func:`portattn.paged_attention` on torch: the host plan of query tiles and splits
(:mod:`._paged_tiles`), the tiles' programs, then the merge of the tiles cut into
several splits. Both kernels write the packed ``(T, Hq, Dv)`` output and ``(Hq, T)``
lse in place, sinks joined."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any

from ._configs import block_dim, merge_warps, paged_config, paged_max_rows

if TYPE_CHECKING:
    from portattn.kernel import PagedInputs

    from ._configs import Config
    from ._paged_tiles import TilePlan

__all__ = ["paged_forward", "paged_rows_limit"]


def paged_rows_limit(call: PagedInputs) -> int:
    """The most packed rows (query heads of a group times queries) one program's tile
    holds at this dtype and head dim; 0 where the kernel has no tile."""
    dims = max(block_dim(call.query.shape[2]), block_dim(call.value_pages.shape[-1]))
    return paged_max_rows(_element_bytes(call.dtype), dims)


def paged_forward(call: PagedInputs, num_splits: int | None = None,
                  block_m: int | None = None) -> tuple[Any, Any]:
    """``(out (T, Hq, Dv), lse (Hq, T) float32)`` of the paged call ``call`` (torch
    tensors on the pools' device). ``num_splits`` caps the slices of each tile's keys
    (None: about two programs per multiprocessor); ``block_m`` sets the tiles' rows
    (None: the most rows of one sequence; rounded up to a power of two, at most the
    tallest tile)."""
    import torch

    from ._paged_tiles import plan_tiles

    q, v_pool = call.query, call.value_pages
    total, hq, d = q.shape
    dv, hkv = v_pool.shape[-1], call.num_kv_heads
    group = hq // hkv
    dev = q.device
    out = torch.empty((total, hq, dv), dtype=q.dtype, device=dev)
    lse = torch.empty((hq, total), dtype=torch.float32, device=dev)
    if total == 0:
        return out, lse
    most = max(b - a for a, b in pairwise(call.query_starts))
    config = paged_config(q.element_size(), d, dv, group * most if block_m is None
                          else block_m)
    sms = (torch.cuda.get_device_properties(dev).multi_processor_count
           if dev.type == "cuda" else None)
    band = None if call.mask is None else call.mask.band(0, 0)
    bounds = (None, None) if band is None else (band.lower, band.upper)
    plan = plan_tiles(call.query_starts, call.key_lengths, group, config.block_m,
                      config.block_n, bounds, hkv, sms, num_splits)
    _launch(call, plan, config, bounds, out, lse)
    return out, lse


def _launch(call: PagedInputs, plan: TilePlan, config: Config,
            bounds: tuple[int | None, int | None], out: Any, lse: Any) -> None:
    """The tiles' programs, then the merge of those cut into several splits, writing
    ``out`` and ``lse`` in place."""
    import torch

    from ._launching import on_device, precision
    from ._triton_paged import paged_merge_kernel, paged_tile_kernel

    q, k_pool, v_pool = call.query, call.key_pages, call.value_pages
    dev, d, dv, hkv = q.device, q.shape[2], v_pool.shape[-1], call.num_kv_heads
    group, bdv = q.shape[1] // hkv, block_dim(dv)
    items = torch.from_numpy(plan.items).to(dev)
    part_out = torch.empty((plan.parts, hkv, config.block_m, bdv), dtype=torch.float32,
                           device=dev)
    part_lse = torch.empty((plan.parts, hkv, config.block_m), dtype=torch.float32,
                           device=dev)
    table = call.block_table.to(torch.int32).contiguous()
    slopes, sinks = (None if a is None else a.to(torch.float32).contiguous()
                     for a in (call.alibi_slopes, call.sinks))
    dummy = part_lse if plan.parts else lse  # stands in for absent tensors; never read
    lower, upper = bounds
    tile_args = (group, plan.tile_heads, plan.tile_queries)
    with on_device(dev):
        paged_tile_kernel[(len(plan.items), hkv)](
            q, k_pool, v_pool, out, lse, part_out, part_lse, items, table,
            dummy if slopes is None else slopes, dummy if sinks is None else sinks,
            *q.stride(), *_pool_strides(k_pool, call.head_major),
            *_pool_strides(v_pool, call.head_major), *out.stride(), lse.stride(0),
            table.stride(0), *tile_args, call.page_size, d, dv, call.scale,
            1.0 if call.softcap is None else call.softcap,
            0 if lower is None else lower, 0 if upper is None else upper,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_dim(d),
            BLOCK_DV=bdv, HAS_LOWER=lower is not None, HAS_UPPER=upper is not None,
            HAS_ALIBI=slopes is not None, HAS_SINKS=sinks is not None,
            SOFTCAP=call.softcap is not None, INPUT_PRECISION=precision(q.dtype),
            num_warps=config.num_warps, num_stages=config.num_stages)
        if len(plan.merges):
            paged_merge_kernel[(len(plan.merges), hkv)](
                part_out, part_lse, out, lse, torch.from_numpy(plan.merges).to(dev),
                dummy if sinks is None else sinks, *out.stride(), lse.stride(0),
                *tile_args, dv, BLOCK_M=config.block_m, BLOCK_DV=bdv,
                HAS_SINKS=sinks is not None, num_warps=merge_warps(config.block_m, bdv))


def _pool_strides(pool: Any, head_major: bool) -> tuple[int, ...]:
    """A pool's strides as (page, row in page, head, dim), whichever its layout."""
    s = pool.stride()
    return (s[0], s[2], s[1], s[3]) if head_major else s


def _element_bytes(dtype: str) -> int:
    return 2 if dtype in ("float16", "bfloat16") else 4
