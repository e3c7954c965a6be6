"""The values ``python -m portattn tune`` chose for kernels' ``tunables``, as kernels
read them (``Kernel.tuned``).

Apart from dispatch's tune file, which knows the registry, so that
:mod:`portattn.kernel` depends on nothing of dispatch: dispatch installs its reader
here when it is imported (as ``import portattn`` does).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

__all__ = ["install", "trying", "value"]

_reader: list[Callable[[], Mapping[str, Mapping[str, Any]]]] = []
_trial: ContextVar[tuple[str, str, Any] | None] = ContextVar("portattn_tune_trial",
                                                             default=None)


def install(reader: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
    """``reader()`` gives ``kernel name -> setting -> value`` of the usable tune file."""
    _reader[:] = [reader]


@contextlib.contextmanager
def trying(kernel: str, setting: str, candidate: Any) -> Iterator[None]:
    """Within the block, ``kernel`` reads ``candidate`` for ``setting`` (how tune times
    each value)."""
    token = _trial.set((kernel, setting, candidate))
    try:
        yield
    finally:
        _trial.reset(token)


def value(kernel: str, setting: str) -> Any:
    """``kernel``'s ``setting`` as tuned here, None when there is none."""
    trial = _trial.get()
    if trial is not None and trial[:2] == (kernel, setting):
        return trial[2]
    settings = _reader[0]() if _reader else {}
    return settings.get(kernel, {}).get(setting)
