"""Strategies: the ways a call is cut into units, and a unit computed.

Each strategy is a small object made for one call by its module's ``plan(problem,
config, loops, plans, threads)``, which returns None where it does not apply; it holds
the call's settings and loops (and plans, where it plans units by their blocks):

* ``stacked`` (``_stacked``): small heads, many whole heads to a unit;
* ``diagonal`` (``_diagonal``): causal-shaped masks, runs of squares along the diagonal;
* ``tiles`` (``_tiles``): everything else, query tiles against key blocks.

They are tried in that order (``Config.strategies`` can leave some out). A strategy's
``attend`` tries the fast way (the unshifted exponential) and says whether it could be
trusted; a unit it cannot trust is computed again in tiles, the careful way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import _diagonal, _stacked, _tiles
from ._scratch import reusing

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._config import Config
    from ._loops import Loops
    from ._memo import CallPlans
    from ._problem import Problem
    from ._tiles import Tiles
    from ._units import Unit

__all__ = ["Strategy", "choose", "work"]


class Strategy(Protocol):
    """One way through a call."""

    name: str

    def units(self, p: Problem, b: tuple[int, ...]) -> list[Unit]:
        """The units of batch element ``b``; none with nothing to attend."""

    def heads(self, p: Problem, h: int) -> range:
        """The query heads of the unit whose first head is ``h``."""

    def prepare(self, p: Problem, units: list[Unit]) -> None:
        """Plan ahead of the workers what ``units`` will need (the calling thread does
        this while the others compute the units already planned)."""

    def scratch(self, p: Problem) -> Any:
        """One worker's buffers, reused for every unit it takes."""

    def attend(self, p: Problem, scratch: Any, unit: Unit) -> bool:
        """The unit the fast way; False when it must be redone carefully."""


_PLANNERS = {"stacked": _stacked.plan, "diagonal": _diagonal.plan, "tiles": _tiles.plan}


def choose(p: Problem, config: Config, loops: Loops, plans: CallPlans,
           threads: int) -> Strategy:
    """The first strategy of ``config.strategies`` that applies (``tiles`` always does)."""
    for name in config.strategies:
        found = _PLANNERS[name](p, config, loops, plans, threads)
        if found is not None:
            return found
    return _tiles.plan(p, config, loops, plans, threads)


def work(p: Problem, config: Config, strategy: Strategy, careful: Tiles,
         units: Iterable[Unit]) -> None:
    """Compute every unit taken from ``units`` (one worker thread); the units the fast
    way cannot trust are redone by ``careful``."""
    # overflow is detected by value, masked rows by design
    with np.errstate(all="ignore"), reusing():
        scratch = strategy.scratch(p)
        careful_scratch = None
        for unit in units:
            trusted = config.try_fast and strategy.attend(p, scratch, unit)
            if config.on_unit is not None and config.try_fast:
                config.on_unit(strategy.name, trusted)
            if not trusted:
                careful_scratch = careful_scratch or careful.careful_scratch(p)
                careful.redo_carefully(p, careful_scratch, unit, strategy.heads(p, unit.head))
