"""Fixtures for the benchmarks: ``in_turns`` (a ratio against a peer, timed in
alternation) and the sweep's options (``test_sweep.py``).

The sweep is configured with the same options as ``portattn-bench``, passed in
``PORTATTN_BENCH_ARGS`` (e.g. ``"--sizes 512,1024 --backends numpy,torch"``);
``--quick`` (or ``PORTATTN_BENCH_QUICK=1``) keeps it small. The sweep's fixtures
are used only by tests that ask for a ``sweep_*`` fixture.
"""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest

# OpenBLAS's threads spin for ~0.1 s after a multi-threaded product (an sgemm peer) and
# would slow the call timed next; read when OpenBLAS loads, so set before NumPy is.
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from portattn_bench.cases import SweepConfig
    from portattn_bench.sweep import History, Inputs

ARGS_ENV = "PORTATTN_BENCH_ARGS"
SETTLE = 0.05
QUICK_ENV = "PORTATTN_BENCH_QUICK"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("portattn sweep")
    group.addoption("--quick", action="store_true", default=False,
                    help=f"small attention sweep (also {QUICK_ENV}=1); more options "
                         f"as `portattn-bench` flags in {ARGS_ENV}")


def sweep_settings(config: pytest.Config) -> SweepConfig:
    """The sweep's settings, parsed like the command line's (cached per session)."""
    cached = getattr(config, "_portattn_sweep", None)
    if cached is None:
        from portattn_bench.cli import parse

        argv = shlex.split(os.environ.get(ARGS_ENV, ""))
        if config.getoption("--quick") or os.environ.get(QUICK_ENV, "") not in ("", "0"):
            argv.append("--quick")
        cached = parse(argv)[0]
        config._portattn_sweep = cached  # type: ignore[attr-defined]
    return cached


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sweep_case" not in metafunc.fixturenames:
        return
    from portattn_bench.cases import plan
    from portattn_bench.runners import all_runners

    planned = plan(sweep_settings(metafunc.config), all_runners())
    metafunc.parametrize("sweep_case", planned.cases, ids=str)


@pytest.fixture(scope="session")
def sweep_config(pytestconfig: pytest.Config) -> SweepConfig:
    return sweep_settings(pytestconfig)


@pytest.fixture(scope="session")
def sweep_history(sweep_config: SweepConfig) -> History:
    """Measurements so far, to skip sizes predicted to exceed the time/memory limits."""
    from portattn_bench.sweep import History

    return History(sweep_config)


@pytest.fixture(scope="session")
def sweep_inputs() -> Iterator[Inputs]:
    from portattn_bench.sweep import Inputs

    inputs = Inputs()
    yield inputs
    inputs.clear()


@pytest.fixture
def in_turns(benchmark: Any) -> Callable[..., tuple[float, float]]:
    """``in_turns(ours, peer, rounds)`` benchmarks ``ours`` with ``peer`` run and timed
    just before each round, and returns min(ours) / min(peer) and the median of the
    per-round ratios.

    On a shared machine the speed drifts by tens of percent within a minute; timing two
    functions in separate benchmarks folds that drift into their ratio, timing them in
    turns cancels most of it. Each call is followed by a pause of ``SETTLE`` seconds:
    torch's OpenMP threads keep spinning on the cores for a while after a call, and
    would slow down whatever runs next.
    """
    def measure(ours: Callable[[], Any], peer: Callable[[], Any],
                rounds: int) -> tuple[float, float]:
        peer_times: list[float] = []

        def run_peer() -> None:
            start = time.perf_counter()
            peer()
            peer_times.append(time.perf_counter() - start)
            time.sleep(SETTLE)

        benchmark.pedantic(ours, setup=run_peer, teardown=lambda: time.sleep(SETTLE),
                           rounds=rounds, warmup_rounds=1)
        ours_times = list(benchmark.stats.stats.data)
        peer_times = peer_times[-rounds:]  # the warm-up round's is not paired
        per_round = [a / b for a, b in zip(ours_times, peer_times, strict=True)]
        return min(ours_times) / min(peer_times), statistics.median(per_round)

    return measure
