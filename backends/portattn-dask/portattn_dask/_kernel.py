"""The ``dask_blockwise`` kernel: its declarations and its entry point."""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING, Any

from portattn.kernel import ANY, Kernel
from portattn.masks import KINDS

from ._block import NAME

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["DaskBlockwiseKernel"]


class DaskBlockwiseKernel(Kernel):
    """Attention on Dask arrays as a lazy graph of per-chunk attention calls.

    Batch and head chunks are independent blocks, query-length chunks map blockwise,
    and key-length chunks are computed separately and merged exactly (split-KV), so no
    task holds all keys. Each block runs through ``portattn.attention`` on the chunks
    themselves, so the registry picks the best kernel for their library and device.
    Every mask kind is read through its block form on the chunk grid: blocks it hides
    completely are never scheduled, and each other block gets its own restricted mask
    (none where it sees every pair).
    """

    name = NAME
    namespaces = frozenset({"dask"})
    devices = ANY  # the chunks' own kernels decide where they run
    dtypes = frozenset({"float16", "float32", "float64"})  # as the chunk libraries offer
    masks = frozenset(KINDS)
    bias = softcap = alibi = sinks = gqa = value_head_dim = empty = True
    returns_lse = True
    priority = 100

    @classmethod
    def check_available(cls) -> str | None:
        # Detect, don't import: dispatching a NumPy call must not import dask.
        if importlib.util.find_spec("dask") is None:
            return "dask is not installed"
        return None

    @classmethod
    def not_supported_reasons(cls, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        for name in ("query", "key", "value"):
            chunks = getattr(getattr(inputs, name), "chunks", ())
            if any(math.isnan(size) for axis in chunks for size in axis):
                reasons.append(f"{name} has unknown chunk sizes (call compute_chunk_sizes())")
        return reasons

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        from ._graph import blockwise_attention

        if math.prod(inputs.batch_shape) * inputs.num_heads == 0:
            return *_no_rows(inputs), None
        out, lse = blockwise_attention(inputs)
        return out, lse, None


def _no_rows(inputs: AttentionInputs) -> tuple[Any, Any]:
    """Zero-size results of a call without (batch, head) rows. Allocated with every
    axis at least 1, then sliced: Dask's automatic chunking divides by zero on some
    zero-size shapes."""
    lead = (*inputs.batch_shape, inputs.num_heads, inputs.q_len)

    def empty(shape: tuple[int, ...], dtype: Any) -> Any:
        full = inputs.xp.zeros(tuple(max(n, 1) for n in shape), dtype=dtype)
        return full[tuple(slice(0, n) for n in shape)]

    out = empty((*lead, inputs.value_head_dim), inputs.query.dtype)
    return out, empty(lead, inputs.compute_dtype) if inputs.return_lse else None
