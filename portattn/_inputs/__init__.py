"""A call described: what :func:`portattn.attention` was given, checked and frozen
(:class:`AttentionInputs`: arrays, namespace, device, dtypes, shapes, the mask bound
to the call, options), a paged call (:class:`PagedInputs`), and the two layouts
arrays come in.

Every kernel reads a call through this description, and dispatch decides from it.
It may import :mod:`portattn.masks`, :mod:`portattn._lib` and :mod:`portattn.errors`.
"""

from __future__ import annotations

from ._describe import AttentionInputs, describe
from ._layout import LAYOUTS, check_layout, from_kernel_layout, shown, to_kernel_layout
from ._paged import PagedInputs, QueryTiles

__all__ = ["LAYOUTS", "AttentionInputs", "PagedInputs", "QueryTiles", "check_layout", "describe",
           "from_kernel_layout", "shown", "to_kernel_layout"]
