"""The vector-Jacobian product of a function, by the autodiff of the library whose
arrays it takes, as its plugin adds it (the ``vjp`` part, :mod:`._plugins`): how a
kernel gets the derivatives of a function the user wrote, tile by tile."""

from __future__ import annotations

from typing import Any

from ._arrays import namespace_name
from ._plugins import vjp_for

__all__ = ["vjp"]


def vjp(xp: Any, fn: Any, primals: tuple[Any, ...], cotangent: Any) -> tuple[Any, ...]:
    """The gradient of ``sum(fn(*primals) * cotangent)`` with respect to each primal.

    Raises:
        TypeError: arrays of a library without autodiff (NumPy, CuPy, Dask, ...), or
            whose plugin is not installed.
    """
    name = namespace_name(xp)
    found = vjp_for(name)
    if found is None:
        msg = (f"the gradient of a score function needs autodiff, which {name} arrays lack "
               "here (torch and JAX have it, through portattn-torch and portattn-jax); "
               "or use a score change with its own derivative (portattn.scores)")
        raise TypeError(msg)
    return tuple(found(fn, primals, cotangent))
