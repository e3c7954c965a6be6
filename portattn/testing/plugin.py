"""pytest plugin: the ``backend`` and ``xp`` fixtures, and the one backend-selection rule.

Load it from the top-level conftest (``pytest_plugins = ["portattn.testing.plugin"]``),
or import the fixtures into any conftest (``from portattn.testing.plugin import backend,
xp``), which is how each plugin's own suite gets them. Tests that take ``backend`` or
``xp`` run once per backend, ids like ``test_causal[torch]``.

The rule, the same in every suite: ``PORTATTN_TEST_BACKENDS=numpy,torch`` selects
backends (default: every backend, each skipped when its library or device is missing).
A selected backend that cannot be loaded fails, never skips; so does a library a
selected backend stands on (:func:`require_library`).
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from typing import TYPE_CHECKING, Any

import pytest

from .backends import BACKEND_NAMES, get_backend

if TYPE_CHECKING:
    from .backends import Backend

__all__ = ["ENV", "backend", "require_backend", "require_library", "selected_backends", "xp"]

ENV = "PORTATTN_TEST_BACKENDS"
"""The environment variable that selects backends (names joined by commas)."""

# Suites test the declared dispatch: a tune file of the machine's (python -m portattn
# tune) must not change which kernel a test gets. Tests of tuning set their own file.
os.environ["PORTATTN_TUNE_FILE"] = ""

#: The backends whose selection promises that a library is importable.
_LIBRARY_BACKENDS = {
    "numpy": ("numpy", "dask"),
    "array_api_strict": ("array_api_strict",),
    "torch": ("torch", "torch_cuda"),
    "jax": ("jax", "jax_cuda"),
    "dask": ("dask",),
    "cupy": ("cupy",),
}


def selected_backends() -> tuple[str, ...] | None:
    """The backends named by ``PORTATTN_TEST_BACKENDS``.

    A name that is not one of :data:`~portattn.testing.BACKEND_NAMES` stops the run
    (``pytest.UsageError``).

    Returns:
        The names in the order given; None when the variable is unset or empty.

    Example:
        >>> import os
        >>> from unittest import mock
        >>> from portattn.testing.plugin import ENV, selected_backends
        >>> with mock.patch.dict(os.environ, {ENV: "numpy, torch"}):
        ...     selected_backends()
        ('numpy', 'torch')
    """
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in BACKEND_NAMES]
    if unknown:
        msg = f"{ENV} names unknown backends {unknown}; known: {', '.join(BACKEND_NAMES)}"
        raise pytest.UsageError(msg)
    return names


def require_backend(name: str) -> Backend:
    """The test backend ``name`` for a test that needs that one backend.

    Skips when a selection leaves it out or, with no selection, when it cannot be
    loaded here; fails when it is selected but cannot be loaded.

    Args:
        name: one of :data:`~portattn.testing.BACKEND_NAMES`.

    Returns:
        The :class:`~portattn.testing.Backend`.

    Example:
        In a test module::

            from portattn.testing.plugin import require_backend

            def test_on_torch():
                torch_backend = require_backend("torch")
                ...
    """
    chosen = selected_backends()
    if chosen is not None and name not in chosen:
        pytest.skip(f"backend {name} is not selected by {ENV}={','.join(chosen)}")
    try:
        return get_backend(name)
    except ImportError as e:
        if chosen is not None:
            pytest.fail(f"backend {name} is selected by {ENV} but cannot be loaded: {e}",
                        pytrace=False)
        pytest.skip(f"backend {name} not available: {e}")


def require_library(module: str, *, backend: str | None = None) -> Any:
    """Import ``module`` for a test module (call at module level) or a test.

    It must import when a selected backend stands on it (``backend``, or by default the
    backends of the library ``module`` belongs to): a missing one then fails the run.
    Otherwise a missing module skips, like ``pytest.importorskip``.

    Args:
        module: the module's dotted name.
        backend: the backend whose selection makes the module required; by default
            those of the library ``module`` belongs to.

    Returns:
        The imported module.

    Example:
        >>> from portattn.testing.plugin import require_library
        >>> require_library("numpy.linalg").__name__
        'numpy.linalg'
    """
    chosen = selected_backends() or ()
    owners = (backend,) if backend else _LIBRARY_BACKENDS.get(module.split(".")[0], ())
    needed_by = [b for b in owners if b in chosen]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if needed_by:
            pytest.fail(f"{module} cannot be imported, but backend {needed_by[0]} needs it "
                        f"and is selected by {ENV}: {e}", pytrace=False)
        pytest.skip(f"{module} is not installed: {e}", allow_module_level=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cross: needs two array libraries (run with -m cross where both are "
                   "selected: the cross tox env)")


#: Every program XLA compiles for the CPU maps its code into the process, and a long run
#: on JAX compiles thousands: at the kernel's limit on mappings (``vm.max_map_count``,
#: 65,530 by default) XLA's compiler crashes the process. Past half the limit, checked
#: every ``_MAPPINGS_CHECK_EVERY`` tests, the suite drops JAX's compiled programs.
_MAPPINGS_CHECK_EVERY = 25
_finished_tests = itertools.count(1)


def _process_mappings() -> tuple[int, int] | None:
    """This process's memory mappings and the system's limit on them.

    Returns:
        ``(in use, limit)``; None where ``/proc`` does not tell (not Linux).
    """
    try:
        with open("/proc/self/maps", "rb") as f:
            in_use = f.read().count(b"\n")
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return None
    return in_use, limit


def pytest_runtest_teardown(item: pytest.Item) -> None:
    if next(_finished_tests) % _MAPPINGS_CHECK_EVERY or "jax" not in sys.modules:
        return
    mappings = _process_mappings()
    if mappings is not None and mappings[0] > mappings[1] // 2:
        sys.modules["jax"].clear_caches()


def pytest_report_header(config: pytest.Config) -> str:
    chosen = selected_backends()
    return f"portattn test backends: {', '.join(chosen) if chosen else 'all installed'}"


@pytest.fixture(scope="session", params=selected_backends() or BACKEND_NAMES)
def backend(request: pytest.FixtureRequest) -> Backend:
    """Fixture: each selected backend in turn (ids are the backend names).

    Returns:
        A :class:`~portattn.testing.Backend`, as :func:`require_backend` gives it.

    Example:
        In a test module (with the plugin loaded, or the fixtures imported into its
        ``conftest.py``)::

            def test_shape(backend):
                q = backend.asarray(numpy.zeros((1, 2, 8, 4)), "float32")
                assert portattn.attention(q, q, q).shape == (1, 2, 8, 4)
    """
    return require_backend(request.param)


@pytest.fixture
def xp(backend: Backend) -> Any:
    """Fixture: the array namespace of :func:`backend`, one test per selected backend.

    Returns:
        ``backend.xp``.

    Example:
        In a test module::

            def test_zeros(xp):
                q = xp.zeros((1, 2, 8, 4))
                assert portattn.attention(q, q, q).shape == (1, 2, 8, 4)
    """
    return backend.xp
