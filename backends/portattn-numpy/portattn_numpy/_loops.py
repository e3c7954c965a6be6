"""The loops that compute one call: its exponential (``_exponential``) and, where
they can run, the fast way's blocks compiled (``_compiled_blocks``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _jit
from ._exponential import in_place, in_rows

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._compiled_blocks import CompiledBlocks
    from ._config import Config

__all__ = ["Loops", "loops_for"]


@dataclass(frozen=True)
class Loops:
    """Which loops one call runs."""

    exponential: Callable[[Any], None]
    """``exponential(a)`` exponentiates ``a`` in place, in the scores' base."""
    exponential_rows: Callable[..., None] | None
    """The same over a score tile's rows with their sums in one pass, where it is
    compiled (``_exponential.in_rows``); None otherwise."""
    compiled: CompiledBlocks | None
    """The fast way's blocks and its last step, compiled to run with no GIL, where
    they can; None otherwise."""


def loops_for(config: Config, exponential: str, query: Any, value: Any,
              softcap: float | None) -> Loops:
    """The loops of a call whose scores go through ``exponential``."""
    return Loops(in_place(exponential), in_rows(exponential),
                 _compiled(config, exponential, query, value, softcap))


def _compiled(config: Config, exponential: str, query: Any, value: Any,
              softcap: float | None) -> CompiledBlocks | None:
    """The compiled blocks where they apply: scores in base 2 through the compiled
    ``exp2``, no softcap, NumPy's BLAS found, and heads of at least one column."""
    if not config.compiled_blocks or exponential != "exp2_compiled" or softcap is not None:
        return None
    if min(query.shape[-1], value.shape[-1]) < 1:
        return None
    module = _jit.load("_compiled_blocks")  # needs Numba, an optional dependency
    return None if module is None else module.compiled_blocks(query.dtype)
