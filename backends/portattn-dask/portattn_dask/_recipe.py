"""A block's mask in a form that travels in the graph, to threads or to workers.

The client restricts the mask to each block (``Mask.restrict``) and ships the result;
three things cannot travel as they are and are rebuilt in the task:

- mask functions (a bound one holds a lock): the function itself travels, with the
  offsets that turn the block's batch, head, query and key indices into the call's;
- dense masks: the block's chunk of the array arrives as a task input;
- a restricted kind that its own checks refuse for the block's shapes (a global token
  or prefix length past the block's keys, lengths a per-sequence window is aligned to
  that exceed the block): the kind's rule (``Mask.allows``) travels as a mask
  function of the block's indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import reduce
from operator import and_, or_
from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace

from portattn import masks

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["Block", "DensePiece", "FunctionAt", "KindRule", "Recipe", "recipe"]


@dataclass(frozen=True)
class FunctionAt:
    """A mask function seen from one block: ``fn`` of the call's indices."""

    fn: Callable[..., Any]
    batch_shape: tuple[int, ...]
    """The call's batch shape."""
    block_batch: tuple[int, ...]
    batch_start: tuple[int, ...]
    head_start: int
    q_start: int
    k_start: int
    args: tuple[Any, ...] | None = field(default=None, compare=False)
    """The function's arguments (host arrays), or None when it declares none; a mask's
    content key holds their values (arrays do not hash)."""

    def __call__(self, b: Any, h: Any, q: Any, k: Any, *args: Any) -> Any:
        return self.fn(self._call_batch(b), h + self.head_start, q + self.q_start,
                       k + self.k_start, *args)

    def _call_batch(self, b: Any) -> Any:
        """Flat batch index of the call from the block's flat index."""
        if self.block_batch == self.batch_shape:  # every batch element: the same index
            return b
        coords, rest = [], b
        for size in reversed(self.block_batch):
            coords.append(rest % size)
            rest = rest // size
        flat = b * 0  # keeps the array type of ``b``
        for size, coord, start in zip(self.batch_shape, reversed(coords), self.batch_start,
                                      strict=True):
            flat = flat * size + (coord + start)
        return flat


@dataclass(frozen=True)
class KindRule:
    """A restricted kind, applied pair by pair through its ``allows``."""

    mask: masks.Mask
    q_len: int
    kv_len: int

    def __call__(self, b: Any, h: Any, q: Any, k: Any) -> Any:
        return self.mask.allows(array_namespace(q), b, h, q, k, self.q_len, self.kv_len)


@dataclass(frozen=True)
class DensePiece:
    """The block's chunk of the mask's dense array number ``index``."""

    index: int


@dataclass(frozen=True)
class Recipe:
    """A block's mask: kinds, :class:`FunctionAt`, :class:`KindRule` and
    :class:`DensePiece` leaves under ``("&" | "|", members)`` nodes."""

    tree: Any

    def build(self, dense: Sequence[Any], like: Any) -> masks.Mask:
        """The mask, with ``dense`` the block's chunks of the dense arrays and its other
        arrays moved to the library of the chunk ``like``."""
        return _build(self.tree, dense, like)


@dataclass(frozen=True)
class Block:
    """Where a block sits in the call (of batch shape ``batch_shape``): batch elements
    ``batch_start`` on, ``block_batch`` of them, ``heads`` query heads from
    ``head_start``, ``q_len`` queries and ``kv_len`` keys."""

    batch_shape: tuple[int, ...]
    block_batch: tuple[int, ...]
    batch_start: tuple[int, ...]
    head_start: int
    heads: int
    q_len: int
    kv_len: int


def recipe(restricted: masks.Mask, block: Block) -> Recipe:
    """The :class:`Recipe` of a mask already restricted to ``block`` (its dense parts
    numbered in the order they appear)."""
    counter = iter(range(len(restricted.arrays)))
    return Recipe(_encode(restricted, block, counter))


def _encode(mask: masks.Mask, block: Block, dense_numbers: Any) -> Any:
    if isinstance(mask, (masks.Intersection, masks.Union)):
        op = "&" if isinstance(mask, masks.Intersection) else "|"
        return op, tuple(_encode(m, block, dense_numbers) for m in mask.members)
    if mask.pairs:  # a dense mask: the block's chunk arrives as a task input
        return DensePiece(next(dense_numbers))
    if isinstance(mask, masks.Function):
        return FunctionAt(mask.fn, block.batch_shape, block.block_batch, block.batch_start,
                          block.head_start, mask.q_origin, mask.k_origin, mask.args)
    if not mask.arrays:  # positions alone: a restricted kind fits any block
        return mask
    try:  # what the chunk call will do with it
        mask.bind(array_namespace(*mask.arrays), block.block_batch, block.heads, block.q_len,
                  block.kv_len)
    except ValueError:
        return KindRule(mask, block.q_len, block.kv_len)
    return mask


def _build(tree: Any, dense: Sequence[Any], like: Any) -> masks.Mask:
    if isinstance(tree, tuple):
        op, members = tree
        return reduce(and_ if op == "&" else or_, (_build(m, dense, like) for m in members))
    if isinstance(tree, DensePiece):
        return masks.dense(dense[tree.index])
    if isinstance(tree, FunctionAt):
        return masks.function(tree, args=None if tree.args is None else tuple(
            _like(a, like) for a in tree.args))
    if isinstance(tree, KindRule):
        return masks.function(KindRule(_moved(tree.mask, like), tree.q_len, tree.kv_len))
    return _moved(tree, like)


def _moved(mask: masks.Mask, like: Any) -> masks.Mask:
    """``mask`` holding its arrays in the library and on the device of the chunk ``like``."""
    return mask.with_arrays([_like(a, like) for a in mask.arrays]) if mask.arrays else mask


def _like(a: Any, like: Any) -> Any:
    """``a`` (a host array) in the library and on the device of the chunk ``like``."""
    if type(a) is type(like):
        return a
    from array_api_compat import device

    return array_namespace(like).asarray(a, device=device(like))
