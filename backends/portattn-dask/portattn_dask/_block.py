"""What one task runs, on the chunks themselves (NumPy, CuPy, ...).

These functions are referenced by the graph and pickled by name, so workers of a
distributed cluster import this module; they see plain chunks, never Dask arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace
from array_api_compat import device as device_of

import portattn
from portattn import masks
from portattn.overrides import KernelOverrides, kernel_overrides

from ._alibi import BlockAlibi, block_alibi

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._recipe import Recipe

__all__ = ["BlockCall", "ChunkCall", "Part", "attend", "empty", "merge_blocks"]

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
    overrides: KernelOverrides = field(default_factory=kernel_overrides)
    """``use_kernel`` / ``disable_kernels`` / ``PORTATTN_KERNEL`` where the graph was
    built (the client): the chunks run under them, wherever and whenever they run."""


@dataclass(frozen=True)
class Part:
    """Queries ``[q0, q1)`` against keys ``[k0, k1)`` of the call, with their mask (None
    where the block form says every pair is allowed)."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: Recipe | None


@dataclass(frozen=True)
class BlockCall:
    """One block: a query chunk against a key chunk, run as one chunk call per part
    (more than one only to keep ALiBi exact, see :mod:`portattn_dask._alibi`), whose
    results are merged (``joined="keys"``) or stacked (``"rows"``)."""

    q0: int
    k0: int
    need_lse: bool
    parts: tuple[Part, ...]
    joined: str = "keys"


def attend(call: ChunkCall, block: BlockCall, query: Any, key: Any, value: Any, bias: Any,
           slopes: Any, dense: Sequence[Any]) -> tuple[Any, Any]:
    """``(out, lse)`` of one block, by the best kernel for the chunks' library;
    ``lse`` is None when not needed (so kernels without one can be chosen)."""
    xp = array_namespace(query, key, value)
    merged = block.joined == "keys" and len(block.parts) > 1
    results = [_attend_part(call, block, part, block.need_lse or merged, query, key, value,
                            bias, slopes, dense) for part in block.parts]
    if len(results) == 1:
        return results[0]
    outs, lses = zip(*results, strict=True)
    if merged:
        out, lse = portattn.merge(outs, lses)
    else:
        out = xp.concat(outs, axis=-2)
        lse = xp.concat(lses, axis=-1) if block.need_lse else None
    return out, lse if block.need_lse else None


def _attend_part(call: ChunkCall, block: BlockCall, part: Part, need_lse: bool, query: Any,
                 key: Any, value: Any, bias: Any, slopes: Any, dense: Sequence[Any]
                 ) -> tuple[Any, Any]:
    xp = array_namespace(query, key, value)
    rows = (part.q0 - block.q0, part.q1 - block.q0)  # the part within the block's chunks
    cols = (part.k0 - block.k0, part.k1 - block.k0)
    if rows != (0, query.shape[-2]) or cols != (0, key.shape[-2]):
        query, key, value = (query[..., slice(*rows), :], key[..., slice(*cols), :],
                             value[..., slice(*cols), :])
        bias = None if bias is None else masks.slice_tile(bias, *rows, *cols)
        dense = [masks.slice_tile(d, *rows, *cols) for d in dense]
    alibi = BlockAlibi()
    if slopes is not None:
        alibi = block_alibi(xp, slopes, (part.q0, part.q1, part.k0, part.k1), call.q_len,
                            call.kv_len, _compute_dtype(xp, query), device_of(query))
    if alibi.bias is not None:
        bias = alibi.bias if bias is None else bias + alibi.bias
    kwargs = {"mask": None if part.mask is None else part.mask.build(dense, query),
              "bias": bias, "scale": call.scale, "softcap": call.softcap,
              "return_lse": need_lse,
              "alibi_slopes": None if alibi.slopes is None else _per_head(xp, alibi.slopes,
                                                                          query)}
    with portattn.disable_kernels(*call.overrides.disabled):
        kernel = _chunk_kernel(call.overrides.forced, query, key, value, kwargs)
        result = portattn.attention(query, key, value, **kwargs, kernel=kernel)
    if not need_lse:
        return result, None
    out, lse = result
    # a constant of each row's softmax: it changes the lse, not the output
    return out, lse if alibi.row is None else lse + alibi.row


def _compute_dtype(xp: Any, query: Any) -> Any:
    half = str(query.dtype).rsplit(".", 1)[-1] in ("float16", "bfloat16")
    return xp.float32 if half else query.dtype


def _per_head(xp: Any, values: Any, query: Any) -> Any:
    """A ``(*b | 1, H)`` chunk as a call takes it: ``(*b, H)`` (or ``(H,)``)."""
    return xp.broadcast_to(values, tuple(query.shape[:-2]))


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


def empty(call: ChunkCall, query: Any, sinks: Any = None) -> tuple[Any, Any]:
    """Zeros and an lse of ``-inf`` (each head's sink, with sinks) for a block no key
    can reach."""
    xp = array_namespace(query)
    dev = device_of(query)
    lead = tuple(query.shape[:-1])
    dtype = _compute_dtype(xp, query)
    out = xp.zeros((*lead, call.value_head_dim), dtype=query.dtype, device=dev)
    if sinks is None:
        return out, xp.full(lead, -math.inf, dtype=dtype, device=dev)
    return out, xp.broadcast_to(xp.astype(sinks, dtype)[..., None], lead)


def merge_blocks(results: Sequence[tuple[Any, Any]], sinks: Any = None) -> tuple[Any, Any]:
    """Exact ``(out, lse)`` over the union of a query block's key blocks, and each
    head's sink in the denominator (counted here once, in no block)."""
    outs, lses = zip(*results, strict=True)
    out, lse = portattn.merge(outs, lses) if len(outs) > 1 else (outs[0], lses[0])
    return (out, lse) if sinks is None else _with_sinks(out, lse, sinks)


def _with_sinks(out: Any, lse: Any, sinks: Any) -> tuple[Any, Any]:
    """A sink logit (attending no value) joined to each row's softmax. Quiet on the rows
    the rule for non-finite inputs makes NaN (an lse of NaN or ``+inf``: they stay
    non-finite), and a row with neither keys nor a sink keeps 0 and ``-inf``."""
    xp = array_namespace(out, lse)
    sink = xp.astype(sinks, lse.dtype)[..., None]
    top = xp.maximum(lse, sink)
    top = xp.where(xp.isfinite(top), top, xp.zeros_like(top))
    own = xp.exp(lse - top)
    mass = own + xp.exp(sink - top)
    some = mass != 0  # NaN included
    safe = xp.where(some, mass, xp.ones_like(mass))
    total = xp.where(some, top + xp.log(safe), xp.full_like(mass, -math.inf))
    overflow = own == math.inf
    weight = xp.where(overflow, xp.zeros_like(own), own) / safe
    weight = xp.where(overflow, xp.full_like(own, math.nan), weight)
    scaled = xp.astype(out, lse.dtype) * weight[..., None]
    return xp.astype(scaled, out.dtype), total
