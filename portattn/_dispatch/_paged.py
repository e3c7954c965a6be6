"""Which kernel runs a paged call: the first installed kernel, in dispatch order, that
declares paged calls and takes this one; None leaves it to the portable loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._registry import availability, kernel_entries
from ._select import current_overrides

if TYPE_CHECKING:
    from .._inputs import PagedInputs
    from ..kernel import Kernel

__all__ = ["paged_kernel"]


def paged_kernel(call: PagedInputs) -> Kernel | None:
    """The kernel that runs ``call``; None for the portable loop. Kernels disabled by
    :func:`portattn.disable_kernels` or ``PORTATTN_DISABLE_KERNELS`` are skipped."""
    _, disabled = current_overrides()
    for entry in kernel_entries():
        kernel = entry.kernel
        if kernel is None or entry.name in disabled or not kernel.paged:
            continue
        # the declarations first: availability may import the kernel's library
        if not kernel.paged_reasons(call) and availability(entry) is None:
            return kernel
    return None
