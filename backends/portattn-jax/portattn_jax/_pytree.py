"""portattn masks as JAX pytrees, so a mask can be an argument of a jitted function.

Arrays held by a mask (lengths, dense booleans) and the parts of a combined mask become
pytree children; everything else (alignment, window sizes, shifts) is static structure.
Rebuilding skips ``__init__``: JAX rebuilds with placeholder leaves that are not arrays.
"""

from __future__ import annotations

import sys
from typing import Any

from portattn import masks

__all__ = ["register_mask_pytrees"]

_registered: set[type] = set()


def _register_once_jax_is_here() -> bool:
    # Runs on every mask built until JAX is imported: loading the plugin (kernel
    # discovery) may come first, and then masks passed to jax.jit would not be pytrees.
    if "jax" not in sys.modules:
        return False
    register_mask_pytrees()
    return True


masks.on_mask_created(_register_once_jax_is_here)


def register_mask_pytrees() -> None:
    """Register every mask class with ``jax.tree_util`` (idempotent)."""
    from jax import tree_util

    for cls in _mask_classes(masks.Mask):
        if cls in _registered:
            continue
        tree_util.register_pytree_node(cls, _flatten, _unflatten_for(cls))
        _registered.add(cls)


def _mask_classes(root: type) -> list[type]:
    found = [root]
    for sub in root.__subclasses__():
        found += _mask_classes(sub)
    return found


def _is_child(value: Any) -> bool:
    if isinstance(value, masks.Mask):
        return True
    if isinstance(value, tuple) and value and all(isinstance(v, masks.Mask) for v in value):
        return True
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _flatten(mask: masks.Mask) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    fields = sorted(vars(mask).items())
    names = tuple(n for n, v in fields if _is_child(v))
    static = tuple((n, v) for n, v in fields if not _is_child(v))
    return tuple(vars(mask)[n] for n in names), (names, static)


def _unflatten_for(cls: type) -> Any:
    def unflatten(aux: tuple[Any, ...], children: Any) -> masks.Mask:
        names, static = aux
        mask = cls.__new__(cls)
        vars(mask).update(static)
        vars(mask).update(zip(names, children, strict=True))
        return mask

    return unflatten
