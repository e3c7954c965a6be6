"""What calls of the same shape share: bounded stores of plans, kept across calls.

The blocks of a unit, the diagonal shape of a mask and the plan of a unit along the
diagonal depend on the mask's structure, the shapes and the settings only, where the
mask holds no arrays; heads, batch elements, threads and later calls of that shape
reuse them. Their keys hold the settings (``Config``), so a block with other settings
never sees another's plans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["MAX_REMEMBERED", "Store", "clear_all"]

T = TypeVar("T")
MAX_REMEMBERED = 4096
_MISSING = object()
_stores: list[Store] = []


class Store(Generic[T]):
    """A dict that makes missing values on demand; past :data:`MAX_REMEMBERED` entries
    (shapes that change every call) it starts over."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._found: dict[tuple, T] = {}
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
        if len(self._found) >= MAX_REMEMBERED:
            self._found.clear()
        self._found[key] = value  # a duplicate from another thread is harmless

    def __len__(self) -> int:
        return len(self._found)

    def clear(self) -> None:
        self._found.clear()


def clear_all() -> None:
    """Forget every stored plan."""
    for store in _stores:
        store.clear()
