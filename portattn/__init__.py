"""portattn: exact scaled-dot-product attention for any Python array library.

``import portattn`` imports no array library; the namespace of the arrays you pass
decides which library runs, and the kernel registry decides which kernel. What a
kernel author needs (``Kernel``, ``AttentionInputs``) lives in :mod:`portattn.kernel`.

Example:
    >>> import numpy as np
    >>> import portattn
    >>> from portattn import masks
    >>> q = np.random.default_rng(0).standard_normal((1, 2, 8, 4), dtype=np.float32)
    >>> portattn.attention(q, q, q, mask=masks.causal()).shape
    (1, 2, 8, 4)
"""

from __future__ import annotations

from . import distributed, errors, masks, scores
from ._call import attention, explain, scaled_dot_product_attention
from ._dispatch import (
    KernelEntry,
    PagedPlan,
    Plan,
    disable_kernels,
    kernels,
    refresh_kernels,
    use_kernel,
)
from ._kernels import merge
from ._lib import VERSION as __version__
from .kv_cache import KVCache
from .linear import linear_attention
from .multihead import MultiHeadAttention, multi_head_attention
from .paged import explain_paged, paged_attention
from .paged_cache import PagedKVCache, PagedStep

__all__ = [
    "KVCache",
    "KernelEntry",
    "MultiHeadAttention",
    "PagedKVCache",
    "PagedPlan",
    "PagedStep",
    "Plan",
    "__version__",
    "attention",
    "disable_kernels",
    "distributed",
    "errors",
    "explain",
    "explain_paged",
    "kernels",
    "linear_attention",
    "masks",
    "merge",
    "multi_head_attention",
    "paged_attention",
    "refresh_kernels",
    "scaled_dot_product_attention",
    "scores",
    "use_kernel",
]
