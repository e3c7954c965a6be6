"""Options and fixtures for the sweep benchmark in ``test_sweep.py``.

The sweep is configured with the same options as ``portattn bench``, passed in
``PORTATTN_BENCH_ARGS`` (e.g. ``"--sizes 512,1024 --backends numpy,torch"``);
``--quick`` (or ``PORTATTN_BENCH_QUICK=1``) keeps it small. Everything here is used
only by tests that ask for a ``sweep_*`` fixture.
"""

from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from portattn._bench.cases import SweepConfig
    from portattn._bench.sweep import History, Inputs

ARGS_ENV = "PORTATTN_BENCH_ARGS"
QUICK_ENV = "PORTATTN_BENCH_QUICK"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("portattn sweep")
    group.addoption("--quick", action="store_true", default=False,
                    help=f"small attention sweep (also {QUICK_ENV}=1); more options "
                         f"as `portattn bench` flags in {ARGS_ENV}")


def sweep_settings(config: pytest.Config) -> SweepConfig:
    """The sweep's settings, parsed like the command line's (cached per session)."""
    cached = getattr(config, "_portattn_sweep", None)
    if cached is None:
        from portattn._bench.cli import parse

        argv = shlex.split(os.environ.get(ARGS_ENV, ""))
        if config.getoption("--quick") or os.environ.get(QUICK_ENV, "") not in ("", "0"):
            argv.append("--quick")
        cached = parse(argv)[0]
        config._portattn_sweep = cached  # type: ignore[attr-defined]
    return cached


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sweep_case" not in metafunc.fixturenames:
        return
    from portattn._bench.cases import plan
    from portattn._bench.runners import all_runners

    planned = plan(sweep_settings(metafunc.config), all_runners())
    metafunc.parametrize("sweep_case", planned.cases, ids=str)


@pytest.fixture(scope="session")
def sweep_config(pytestconfig: pytest.Config) -> SweepConfig:
    return sweep_settings(pytestconfig)


@pytest.fixture(scope="session")
def sweep_history(sweep_config: SweepConfig) -> History:
    """Measurements so far, to skip sizes predicted to exceed the time/memory limits."""
    from portattn._bench.sweep import History

    return History(sweep_config)


@pytest.fixture(scope="session")
def sweep_inputs() -> Iterator[Inputs]:
    from portattn._bench.sweep import Inputs

    inputs = Inputs()
    yield inputs
    inputs.clear()
