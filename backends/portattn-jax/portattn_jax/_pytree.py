"""portattn masks as JAX pytrees, so a mask can be an argument of a jitted function.

The arrays a mask holds (``Mask.arrays``: lengths, ids, positions, dense booleans,
layouts) are the pytree's leaves; everything else (kinds, alignment, window sizes,
shifts, a mask function's callable) is static structure, compared by
``Mask.structure``. The host copies a bound mask keeps of its arrays are dropped from
the structure (``with_arrays`` drops them), so they are never leaves and never keep an
old call's values. Rebuilding goes through ``Mask.with_arrays``, which checks nothing:
JAX rebuilds with placeholder leaves that are not arrays.
"""

from __future__ import annotations

from typing import Any

from portattn import masks

__all__ = ["register_mask_pytrees"]

_registered: set[type] = set()


def register_mask_pytrees() -> None:
    """Register every mask class with ``jax.tree_util`` (idempotent). Also the
    ``on_import`` this plugin adds for JAX: the core runs it before the first mask
    built while JAX is imported, whether or not kernels were ever discovered."""
    from jax import tree_util

    for cls in _mask_classes(masks.Mask):
        if cls in _registered:
            continue
        tree_util.register_pytree_node(cls, _flatten, _unflatten)
        _registered.add(cls)


def _mask_classes(root: type) -> list[type]:
    found = [root]
    for sub in root.__subclasses__():
        found += _mask_classes(sub)
    return found


class _Template:
    """A mask with its arrays taken out: the static part of the pytree, equal for
    masks of one structure (so jit reuses its compilation) and holding no array."""

    __slots__ = ("mask",)

    def __init__(self, mask: masks.Mask) -> None:
        self.mask = mask.with_arrays((None,) * len(mask.arrays))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Template) and other.mask.structure() == self.mask.structure()

    def __hash__(self) -> int:
        return hash(self.mask.structure())


def _flatten(mask: masks.Mask) -> tuple[tuple[Any, ...], _Template]:
    return mask.arrays, _Template(mask)


def _unflatten(template: _Template, children: Any) -> masks.Mask:
    return template.mask.with_arrays(tuple(children))
