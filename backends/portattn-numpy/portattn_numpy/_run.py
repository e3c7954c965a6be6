"""Running one call: its plan (``_plan``), then the plan's units on the threads
(``_threads``), each by its strategy's loop (``_stacked``, ``_diagonal``, ``_tiles``),
in bands of rows where a score change's entries are made that way (``_bands``).

The fast way runs first; the units it could not trust are planned again as tiles and
run the careful way (``_plan.careful``). Every plan is made on the calling thread
before its units start: the loops only read it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _diagonal, _stacked, _tiles
from ._bands import bands
from ._plan import build, careful, useful_threads
from ._scratch import reusing
from ._threads import get_num_threads, run_parallel

if TYPE_CHECKING:
    from collections.abc import Iterator

    from portattn.kernel import AttentionInputs

    from ._config import Config
    from ._units import Plan, Unit

__all__ = ["planned"]

#: The loop of each strategy: a module with ``Scratch(plan)`` (one worker's buffers)
#: and ``attend(plan, scratch, unit)`` (False where the fast way cannot be trusted).
_LOOPS = {"stacked": _stacked, "diagonal": _diagonal, "tiles": _tiles}


def planned(inputs: AttentionInputs, config: Config, tile_bytes: int) -> tuple[Any, Any]:
    """``(out, lse)`` of the call, planned with ``config`` and score tiles of
    ``tile_bytes``, then run."""
    threads = get_num_threads()  # a bad PORTATTN_NUMPY_THREADS fails here, clearly
    plan = build(inputs, config, tile_bytes, threads)
    untrusted = _on_threads(plan, threads) if config.try_fast else plan.units
    if untrusted:
        _on_threads(careful(plan, untrusted), threads)
    return plan.problem.out, plan.problem.lse


def _on_threads(plan: Plan, threads: int) -> list[Unit]:
    """Every unit of ``plan``, on as many of ``threads`` as they keep busy; the units
    the fast way could not trust (it wrote nothing of them). Where the score change's
    entries are made a band of rows at a time, band after band (``_bands``)."""
    change = plan.problem.change
    if change is None or not change.banded:
        return _run_units(plan, threads)
    untrusted: list[Unit] = []
    for corner, units in bands(plan.problem, plan.units):
        if corner is not None:
            change.make(*corner, threads=threads)
        untrusted += _run_units(dataclasses.replace(plan, units=units), threads)
    return untrusted


def _run_units(plan: Plan, threads: int) -> list[Unit]:
    """:func:`_on_threads` of units that read what is made already."""
    untrusted: list[Unit] = []
    if not plan.units:
        return untrusted
    loop = _tiles if plan.careful else _LOOPS[plan.strategy.name]
    on_unit = None if plan.careful else plan.config.on_unit

    def worker(units: Iterator[Unit]) -> None:
        # overflow is detected by value, masked rows by design
        with np.errstate(all="ignore"), reusing():
            scratch = loop.Scratch(plan)
            for unit in units:
                trusted = loop.attend(plan, scratch, unit)
                if on_unit is not None:
                    on_unit(plan.strategy.name, trusted)
                if not trusted:
                    untrusted.append(unit)

    run_parallel(worker, plan.units, useful_threads(plan, threads))
    return untrusted
