"""Gradients of the portable flash kernel in each library's own autograd.

The math is portable and lives here: :func:`flash_forward` (the tiled forward, which
always returns the log-sum-exp) and :func:`flash_backward` (FlashAttention-2: each
tile's probabilities recomputed from the saved log-sum-exp). What ties them to an
autograd system belongs to that library's plugin, so the core names no library.

A plugin wires a library as the ``attach_autograd`` of what it adds for that library,
an entry point in the group ``portattn.libraries`` named after the namespace
(``torch``, ``jax``, ...)::

    [project.entry-points."portattn.libraries"]
    torch = "portattn_torch._library"     # a module with attach_autograd (and more)

``attach_autograd(inputs) -> (out, lse)`` returns
``flash_forward(inputs)`` recorded so that the library's autograd differentiates it
with ``flash_backward``, saving only ``query, key, value, bias, sinks, out, lse``. The
``tiled`` kernel calls it for calls that need gradients; without one for the call's
library it lets the library record every tile (O(Lq * Lk) memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._kernels import Gradients, flash_backward, tiled_attention
from ._lib import GROUP, attach_for

if TYPE_CHECKING:
    from ._inputs import AttentionInputs

__all__ = ["GROUP", "Gradients", "attach_for", "flash_backward", "flash_forward"]


def flash_forward(inputs: AttentionInputs) -> tuple[Any, Any]:
    """``(out, lse)`` of the tiled kernel, the forward an autograd plugin records.

    Args:
        inputs: the call's :class:`~portattn.kernel.AttentionInputs`.

    Returns:
        ``(out, lse)``: ``out`` ``(..., Hq, Lq, Dv)`` and ``lse`` ``(..., Hq, Lq)`` in
        the compute dtype (float32 for half-precision inputs), always computed.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> from portattn.autograd import flash_forward
        >>> q = np.random.default_rng(0).standard_normal((1, 2, 8, 4))
        >>> inputs = portattn.explain(q, q, q, mask=masks.causal(), kernel="tiled").inputs
        >>> out, lse = flash_forward(inputs)
        >>> out.shape, lse.shape
        ((1, 2, 8, 4), (1, 2, 8))
    """
    return tiled_attention(inputs)
