"""Exceptions raised by portattn.

Input mistakes are plain ``TypeError`` / ``ValueError``. Kernel selection has its own
classes so callers can tell "no kernel fits" from "the kernel you forced cannot run".
"""

from __future__ import annotations

__all__ = ["KernelNotUsableError", "KernelOutputError", "NoKernelError", "PluginWarning",
           "UnknownKernelError"]


class NoKernelError(NotImplementedError):
    """Raised when no installed kernel can honour the call.

    A ``NotImplementedError``; the message lists every kernel with its reasons.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn.errors import NoKernelError
        >>> q = np.zeros((1, 2, 8, 4), dtype=np.float32)
        >>> every = [entry.name for entry in portattn.kernels()]
        >>> try:
        ...     with portattn.disable_kernels(*every):
        ...         portattn.attention(q, q, q)
        ... except NoKernelError as e:
        ...     print(str(e).splitlines()[0])
        no kernel can run attention with these inputs:
    """


class KernelNotUsableError(ValueError):
    """Raised when a kernel forced by name (the ``kernel=`` argument,
    ``PORTATTN_KERNEL`` or ``use_kernel``) cannot run the call.

    A ``ValueError``; the message gives that kernel's reasons.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn.errors import KernelNotUsableError
        >>> q = np.zeros((1, 2, 8, 4), dtype=np.float32)
        >>> try:
        ...     portattn.attention(q, q, q, return_weights=True, kernel="tiled")
        ... except KernelNotUsableError as e:
        ...     print(str(e).splitlines()[0])
        kernel 'tiled' cannot run attention with these inputs:
    """


class UnknownKernelError(KernelNotUsableError):
    """Raised when a kernel is forced by a name that no installed distribution
    provides; the message lists the installed ones.

    A :class:`KernelNotUsableError`.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn.errors import UnknownKernelError
        >>> q = np.zeros((1, 2, 8, 4), dtype=np.float32)
        >>> try:
        ...     portattn.attention(q, q, q, kernel="no_such_kernel")
        ... except UnknownKernelError:
        ...     print("unknown")
        unknown
    """


class PluginWarning(UserWarning):
    """Warned when a kernel plugin cannot be loaded (its kernel is then left out), or
    when two distributions register one kernel name (one of them is used).

    A ``UserWarning``; the message names the distributions.

    Example:
        Turn it into an error, so that a broken plugin cannot go unnoticed:

        >>> import warnings
        >>> import portattn
        >>> from portattn.errors import PluginWarning
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", PluginWarning)
        ...     names = [entry.name for entry in portattn.refresh_kernels()]
        >>> "tiled" in names
        True
    """


class KernelOutputError(RuntimeError):
    """Raised when a kernel returns something other than what it was asked for (a
    wrong shape or dtype, a missing log-sum-exp): a defect of that kernel, named in
    the message.

    A ``RuntimeError``. Only a faulty plugin raises it; another kernel can still run
    the call.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn.errors import KernelOutputError
        >>> q = np.zeros((1, 2, 8, 4), dtype=np.float32)
        >>> try:
        ...     out = portattn.attention(q, q, q)
        ... except KernelOutputError:
        ...     out = portattn.attention(q, q, q, kernel="reference")
        >>> out.shape
        (1, 2, 8, 4)
    """
