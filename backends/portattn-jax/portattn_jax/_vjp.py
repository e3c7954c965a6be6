"""JAX's vector-Jacobian product, for the derivatives of a score function
(``portattn.scores.function``) tile by tile, traced inside the custom VJP's backward."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["vjp"]


def vjp(fn: Any, primals: tuple[Any, ...], cotangent: Any) -> tuple[Any, ...]:
    """The gradient of ``sum(fn(*primals) * cotangent)`` with respect to each primal."""
    return tuple(jax.vjp(fn, *primals)[1](cotangent))
