"""Exceptions raised by portattn.

Input mistakes are plain ``TypeError`` / ``ValueError``. Kernel selection has its own
classes so callers can tell "no kernel fits" from "the kernel you forced cannot run".
"""

from __future__ import annotations

__all__ = ["KernelNotUsableError", "KernelOutputError", "NoKernelError", "PluginWarning",
           "UnknownKernelError"]


class NoKernelError(NotImplementedError):
    """No installed kernel can honour the call; the message lists every kernel's reasons."""


class KernelNotUsableError(ValueError):
    """A kernel forced by name (argument, environment or context) cannot run this call."""


class UnknownKernelError(KernelNotUsableError):
    """A kernel name that no installed distribution provides."""


class PluginWarning(UserWarning):
    """A kernel plugin could not be loaded, or two distributions claim one name."""


class KernelOutputError(RuntimeError):
    """A kernel returned something other than what it was asked for (wrong shape or
    dtype, a missing log-sum-exp): a defect of that kernel, named in the message."""
