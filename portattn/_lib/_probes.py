"""Probes of what an array library is doing now, without importing it: is
torch.compile tracing, is this a JAX tracer, can an array's values be read, will
autograd want gradients.

A library that is not imported cannot have made the array in hand, so every probe
first looks in ``sys.modules`` and answers without importing anything.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["jax_tracer_type", "needs_grad", "torch_compiling", "values_readable", "without_grad"]


def jax_tracer_type() -> type | None:
    """JAX's tracer class, when JAX is imported; never imports JAX itself.

    Returns:
        ``jax.core.Tracer``, or None when JAX is not imported (``jax.core`` itself
        may not be in ``sys.modules``: recent JAX loads it lazily).

    Example:
        >>> import sys
        >>> from portattn.kernel import jax_tracer_type
        >>> jax_tracer_type() is None or "jax" in sys.modules
        True
    """
    import sys

    jax = sys.modules.get("jax")
    core = getattr(jax, "core", None) if jax is not None else None
    return getattr(core, "Tracer", None)


def values_readable(a: Any) -> bool:
    """Whether ``a``'s values can be read now. Reading may still wait for a GPU.

    Args:
        a: an array of any library.

    Returns:
        False for a lazy Dask array, a JAX tracer, or a torch tensor while
        torch.compile traces; True otherwise.

    Example:
        >>> import numpy as np
        >>> from portattn.kernel import values_readable
        >>> values_readable(np.arange(3))
        True
    """
    kind = _kinds.get(type(a))
    if kind is None:  # once per array type: every call asks it
        kind = _kinds[type(a)] = _kind_of(a)
    return kind == "readable" or (kind == "torch" and not torch_compiling())


_kinds: dict[type, str] = {}
"""Per array type: ``"lazy"`` (Dask arrays, JAX tracers: never readable), ``"torch"``
(readable unless torch.compile traces) or ``"readable"``."""


def _kind_of(a: Any) -> str:
    from array_api_compat import is_dask_array

    tracer = jax_tracer_type()
    if is_dask_array(a) or (tracer is not None and isinstance(a, tracer)):
        return "lazy"
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return "torch" if tensor is not None and isinstance(a, tensor) else "readable"


def torch_compiling() -> bool:
    """Whether torch.compile is tracing now; never imports torch.

    Returns:
        ``torch.compiler.is_compiling()``; False when torch is not imported, or is
        still being imported in another thread (its module then has no
        ``compiler`` yet).

    Example:
        >>> from portattn.kernel import torch_compiling
        >>> torch_compiling()
        False
    """
    torch = sys.modules.get("torch")
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return is_compiling is not None and bool(is_compiling())


def needs_grad(arrays: tuple[Any, ...]) -> bool:
    """Whether autograd will want gradients through ``arrays`` (None entries allowed)."""
    # Duck-typed: a torch tensor that requires grad, or a JAX tracer (jit/grad/vmap).
    if any(getattr(a, "requires_grad", False) is True for a in arrays):
        return "torch" in sys.modules and sys.modules["torch"].is_grad_enabled()
    tracer = jax_tracer_type()
    return tracer is not None and any(isinstance(a, tracer) for a in arrays)


def without_grad(a: Any) -> Any:
    """``a`` as a constant of its library's autograd: torch's ``detach()``, JAX's
    ``stop_gradient``; itself for libraries without autograd.

    Example:
        >>> import numpy as np
        >>> from portattn._lib import without_grad
        >>> x = np.ones(2)
        >>> without_grad(x) is x
        True
    """
    detach = getattr(a, "detach", None)
    if detach is not None and getattr(a, "requires_grad", None) is not None:
        return detach()  # torch
    tracer = jax_tracer_type()
    if tracer is not None and isinstance(a, tracer):
        return sys.modules["jax"].lax.stop_gradient(a)
    return a
