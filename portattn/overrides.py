"""The kernel choices a caller has overridden, read as data.

A kernel that defers work (a lazy graph run later, on other threads or processes)
reads them when it builds the work and applies them where the work runs, so that
``use_kernel`` / ``disable_kernels`` around the call, not the place or time the work
happens to run, decide the inner calls' kernels:

>>> from portattn import use_kernel
>>> with use_kernel("tiled"):
...     kernel_overrides()
KernelOverrides(forced='tiled', disabled=frozenset())
"""

from __future__ import annotations

from typing import NamedTuple

from ._dispatch import current_overrides, forced_by_environment

__all__ = ["KernelOverrides", "kernel_overrides"]


class KernelOverrides(NamedTuple):
    """The kernel choices in force for a call, as plain data.

    Example:
        >>> from portattn import disable_kernels
        >>> from portattn.overrides import kernel_overrides
        >>> with disable_kernels("reference"):
        ...     print(sorted(kernel_overrides().disabled))
        ['reference']
    """

    forced: str | None
    """The kernel a call without ``kernel=`` must run: ``use_kernel``, else
    ``PORTATTN_KERNEL``; None when dispatch chooses freely."""
    disabled: frozenset[str]
    """The kernels ``disable_kernels`` removes (``PORTATTN_DISABLE_KERNELS`` removes
    kernels from the registry itself, in every process that inherits it)."""


def kernel_overrides() -> KernelOverrides:
    """The overrides in force here and now (this thread's context managers).

    Returns:
        A :class:`KernelOverrides`: the kernel forced by ``use_kernel`` (else by
        ``PORTATTN_KERNEL``, else None) and those ``disable_kernels`` removes.

    Example:
        >>> from portattn import use_kernel
        >>> from portattn.overrides import kernel_overrides
        >>> with use_kernel("tiled"):
        ...     print(kernel_overrides().forced)
        tiled
    """
    forced, disabled = current_overrides()
    return KernelOverrides(forced or forced_by_environment(), disabled)
