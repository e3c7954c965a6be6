"""torch autograd's vector-Jacobian product, for the derivatives of a score function
(``portattn.scores.function``) tile by tile, inside a backward where grad mode is off."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["vjp"]


def vjp(fn: Any, primals: tuple[Any, ...], cotangent: Any) -> tuple[Any, ...]:
    """The gradient of ``sum(fn(*primals) * cotangent)`` with respect to each primal
    (zeros for one ``fn`` does not read)."""
    with torch.enable_grad():
        leaves = tuple(p.detach().requires_grad_() for p in primals)
        grads = torch.autograd.grad(fn(*leaves), leaves, cotangent, allow_unused=True)
    return tuple(torch.zeros_like(p) if g is None else g
                 for p, g in zip(primals, grads, strict=True))
