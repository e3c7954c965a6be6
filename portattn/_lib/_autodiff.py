"""The vector-Jacobian product of a function, by the autodiff of the library whose
arrays it takes (torch, JAX): how a kernel gets the derivatives of a function the
user wrote, tile by tile. No library is imported here until one is asked for."""

from __future__ import annotations

from typing import Any

from ._arrays import namespace_name

__all__ = ["vjp"]


def vjp(xp: Any, fn: Any, primals: tuple[Any, ...], cotangent: Any) -> tuple[Any, ...]:
    """The gradient of ``sum(fn(*primals) * cotangent)`` with respect to each primal.

    Raises:
        TypeError: arrays of a library without autodiff (NumPy, CuPy, Dask, ...).
    """
    name = namespace_name(xp)
    if name == "torch":
        import torch

        with torch.enable_grad():
            leaves = tuple(p.detach().requires_grad_() for p in primals)
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, cotangent, allow_unused=True)
        return tuple(xp.zeros_like(p) if g is None else g
                     for p, g in zip(primals, grads, strict=True))
    if name == "jax":
        import jax

        return tuple(jax.vjp(fn, *primals)[1](cotangent))
    msg = (f"the gradient of a score function needs autodiff, which {name} arrays lack; "
           "train with torch or JAX, or use a score change with its own derivative "
           "(portattn.scores)")
    raise TypeError(msg)
