"""What calls of the same shape share: bounded stores of plans, kept across calls.

The blocks of a unit, the diagonal shape of a mask and the plan of a unit along the
diagonal depend on the mask's content key (``Mask.content_key``: its structure, and the
values of its arrays), the shapes and the settings only; heads, batch elements and
later calls of that shape reuse them. Their keys hold the settings (``Config``), so
a block with other settings never sees another's plans. What one call keeps for itself
alone (:class:`CallPlans`) lasts while it runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["MAX_BYTES", "MAX_REMEMBERED", "CallPlans", "Store", "clear_all", "size_of"]

T = TypeVar("T")
MAX_REMEMBERED = 4096
MAX_BYTES = 64 << 20
"""What one store may hold (plans hold index arrays that grow with the shapes)."""
_MISSING = object()
_stores: list[Store] = []


class Store(Generic[T]):
    """A dict that makes missing values on demand; past :data:`MAX_REMEMBERED` entries
    or :data:`MAX_BYTES` (shapes that change every call) it starts over."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._found: dict[tuple, T] = {}
        self.nbytes = 0
        _stores.append(self)

    def get(self, key: tuple, make: Callable[[], T]) -> T:
        found = self._found.get(key, _MISSING)
        if found is _MISSING:
            found = make()
            self.put(key, found)
        return found  # type: ignore[return-value]

    def find(self, key: tuple) -> T | None:
        """The value stored for ``key``, or None."""
        return self._found.get(key)

    def put(self, key: tuple, value: T) -> None:
        added = size_of(key) + size_of(value)
        if len(self._found) >= MAX_REMEMBERED or self.nbytes + added > MAX_BYTES:
            self.clear()
        if added <= MAX_BYTES:
            self._found[key] = value  # a duplicate from another thread is harmless
            self.nbytes += added

    def __len__(self) -> int:
        return len(self._found)

    def clear(self) -> None:
        self._found.clear()
        self.nbytes = 0


class CallPlans:
    """What one call keeps while it is planned: the plans of its units, in a
    :class:`Store` shared by later calls under ``shared`` (the settings, the mask's
    content key and the shapes) where the mask has one, else in ``local``; and in
    ``local`` what it reads of its mask once for every unit."""

    def __init__(self, shared: tuple | None) -> None:
        self.shared = shared
        self.local: dict = {}

    def find(self, key: tuple) -> Any:
        """The plan kept under ``key``, or None."""
        if self.shared is not None:
            return _unit_plans.find((self.shared, *key))
        return self.local.get(key)

    def keep(self, key: tuple, plan: Any) -> None:
        """Keep ``plan`` under ``key``: for later calls too where the mask has a content
        key."""
        if self.shared is not None:
            _unit_plans.put((self.shared, *key), plan)
        else:
            self.local[key] = plan


#: Plans of units of masks with a content key, by shape and settings (``CallPlans``).
_unit_plans: Store[Any] = Store("blocks of units")


def size_of(value: Any, _seen: set[int] | None = None) -> int:
    """Bytes ``value`` holds: NumPy arrays, and the containers and this package's
    objects around them (each object once; other objects by their own size only)."""
    seen = set() if _seen is None else _seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, np.ndarray):  # NumPy's sizeof counts the data it owns
        return max(value.nbytes, sys.getsizeof(value))
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        parts: Any = [*value.keys(), *value.values()]
    elif isinstance(value, (tuple, list, set, frozenset)):
        parts = value
    elif type(value).__module__.startswith(__package__):
        known = getattr(value, "nbytes", None)
        if known is not None:  # a plan that counts its bytes itself, without a walk
            return known
        parts = [*getattr(value, "__dict__", {}).values(),
                 *(getattr(value, n, None) for n in getattr(type(value), "__slots__", ()))]
    else:
        return size
    return size + sum(size_of(p, seen) for p in parts)


def clear_all() -> None:
    """Forget every stored plan."""
    for store in _stores:
        store.clear()
