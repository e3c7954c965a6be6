"""What one task runs, on the chunks themselves (NumPy, CuPy, ...).

These functions are referenced by the graph and pickled by name, so workers of a
distributed cluster import this module; they see plain chunks, never Dask arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce
from operator import and_
from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace
from array_api_compat import device as device_of

import portattn
from portattn import masks
from portattn.overrides import KernelOverrides, kernel_overrides

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["ChunkCall", "attend", "empty", "local_mask", "merge_blocks"]

#: This kernel's name (forcing it must not reach the chunks).
NAME = "dask_blockwise"


@dataclass(frozen=True)
class ChunkCall:
    """The parts of one attention call that every block shares."""

    scale: float
    softcap: float | None
    q_len: int
    kv_len: int
    value_head_dim: int
    mask: tuple[masks.Mask | str, ...]
    """As in :class:`portattn_dask._layout.Layout`."""
    overrides: KernelOverrides = field(default_factory=kernel_overrides)
    """``use_kernel`` / ``disable_kernels`` / ``PORTATTN_KERNEL`` where the graph was
    built (the client): the chunks run under them, wherever and whenever they run."""


def local_mask(call: ChunkCall, xp: Any, q0: int, q1: int, k0: int, k1: int,
               arrays: Sequence[Any]) -> masks.Mask | None:
    """The mask of the block ``query[q0:q1] x key[k0:k1]`` in the block's coordinates.

    ``arrays`` are the block's pieces of the mask arrays: lengths for the block's batch
    rows, dense masks already sliced to the block by Dask.
    """
    lq, lk = call.q_len, call.kv_len
    parts = []
    pieces = iter(arrays)
    for entry in call.mask:
        if isinstance(entry, str):
            piece = next(pieces)
            if entry == "dense":
                parts.append(masks.dense(piece))
            else:
                # Lengths are first readable here, when the graph runs: out of range
                # fails as on eager arrays (before restrict() would clip them).
                masks.check_range(xp, piece, lk if entry == "key_lengths" else lq, entry)
                part = getattr(masks, entry)(piece)
                parts.append(part.restrict(xp, q0, q1, k0, k1, lq, lk))
        elif not entry.covers(q0, q1, k0, k1, lq, lk):
            parts.append(entry.restrict(xp, q0, q1, k0, k1, lq, lk))
    return reduce(and_, parts) if parts else None


def attend(call: ChunkCall, q0: int, q1: int, k0: int, k1: int, need_lse: bool,
           query: Any, key: Any, value: Any, bias: Any, mask_arrays: Sequence[Any]
           ) -> tuple[Any, Any]:
    """``(out, lse)`` of one block, by the best kernel for the chunks' library;
    ``lse`` is None when not needed (so kernels without one can be chosen)."""
    xp = array_namespace(query, key, value)
    kwargs = {"mask": local_mask(call, xp, q0, q1, k0, k1, mask_arrays), "bias": bias,
              "scale": call.scale, "softcap": call.softcap, "return_lse": need_lse}
    with portattn.disable_kernels(*call.overrides.disabled):
        kernel = _chunk_kernel(call.overrides.forced, query, key, value, kwargs)
        result = portattn.attention(query, key, value, **kwargs, kernel=kernel)
    return result if need_lse else (result, None)


def _chunk_kernel(forced: str | None, query: Any, key: Any, value: Any,
                  kwargs: dict[str, Any]) -> str | None:
    """The kernel the chunks must run: the one forced on the client, unless that was
    this kernel (it was asked for on the Dask arrays; the chunks get the best kernel
    that can run them). None lets dispatch choose."""
    if forced not in (None, NAME):
        return forced
    if kernel_overrides().forced is None:
        return None
    # This process forces a kernel the client did not (a worker that inherited
    # PORTATTN_KERNEL=dask_blockwise, or whose environment differs): choose here.
    plan = portattn.explain(query, key, value, **kwargs)
    return next((e.name for e, why in plan.candidates if not why and e.name != NAME), None)


def empty(call: ChunkCall, query: Any) -> tuple[Any, Any]:
    """Zeros and an lse of ``-inf`` for a block no key can reach."""
    xp = array_namespace(query)
    dev = device_of(query)
    lead = tuple(query.shape[:-1])
    half = str(query.dtype).rsplit(".", 1)[-1] in ("float16", "bfloat16")
    out = xp.zeros((*lead, call.value_head_dim), dtype=query.dtype, device=dev)
    lse = xp.full(lead, -math.inf, dtype=xp.float32 if half else query.dtype, device=dev)
    return out, lse


def merge_blocks(results: Sequence[tuple[Any, Any]]) -> tuple[Any, Any]:
    """Exact ``(out, lse)`` over the union of a query block's key blocks."""
    outs, lses = zip(*results, strict=True)
    return portattn.merge(outs, lses)
