"""Lookup of the autograd wiring plugins register (see :mod:`portattn.autograd`)."""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from .errors import PluginWarning

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._inputs import AttentionInputs

__all__ = ["GROUP", "attach_for"]

GROUP = "portattn.autograd"


_attached: dict[str, Any] = {}


def attach_for(namespace: str) -> Callable[[AttentionInputs], tuple[Any, Any]] | None:
    """The installed autograd wiring for ``namespace``, or None.

    The entry point is loaded on the first call for a namespace; later calls are a
    plain dict lookup, which ``torch.compile`` traces without a graph break.

    Args:
        namespace: the library's short name, as
            :attr:`AttentionInputs.namespace <portattn.kernel.AttentionInputs.namespace>`
            gives it (``"torch"``, ``"jax"``, ...).

    Returns:
        The callable ``attach(inputs) -> (out, lse)`` registered under that name in
        the entry-point group ``portattn.autograd``; None when no plugin registers
        one, or when it fails to load (with a
        :class:`~portattn.errors.PluginWarning`).

    Example:
        >>> from portattn.autograd import attach_for
        >>> attach_for("numpy") is None  # NumPy has no autograd to wire
        True
    """
    if namespace not in _attached:
        _attached[namespace] = _load(namespace)
    return _attached[namespace]


def _load(namespace: str) -> Callable[[AttentionInputs], tuple[Any, Any]] | None:
    found = [ep for ep in entry_points(group=GROUP) if ep.name == namespace]
    if not found:
        return None
    ep = found[0]
    try:
        return ep.load()
    except Exception as e:  # a broken plugin must not break the call
        msg = (f"portattn: the autograd wiring {ep.name} = {ep.value!r} could not be "
               f"loaded ({type(e).__name__}: {e}); gradients of the tiled kernel on "
               f"{namespace} are recorded tile by tile instead")
        warnings.warn(msg, PluginWarning, stacklevel=3)
        return None
