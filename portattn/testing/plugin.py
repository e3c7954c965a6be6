"""pytest plugin: the ``backend`` and ``xp`` fixtures.

Load it from a conftest (``pytest_plugins = ["portattn.testing.plugin"]``). Tests that
take ``backend`` or ``xp`` run once per backend, ids like ``test_causal[torch]``.
``PORTATTN_TEST_BACKENDS=numpy,torch`` selects backends; a selected backend that cannot
be loaded fails the test instead of skipping it.
"""

from __future__ import annotations

import os

import pytest

from .backends import BACKEND_NAMES, get_backend

ENV = "PORTATTN_TEST_BACKENDS"


def selected_backends() -> tuple[str, ...] | None:
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in BACKEND_NAMES]
    if unknown:
        msg = f"{ENV} names unknown backends {unknown}; known: {', '.join(BACKEND_NAMES)}"
        raise pytest.UsageError(msg)
    return names


def pytest_report_header(config: pytest.Config) -> str:
    chosen = selected_backends()
    return f"portattn test backends: {', '.join(chosen) if chosen else 'all installed'}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        names = selected_backends() or BACKEND_NAMES
        metafunc.parametrize("backend", names, indirect=True, ids=names, scope="session")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest):
    name = request.param
    try:
        return get_backend(name)
    except ImportError as e:
        if selected_backends() is not None:
            pytest.fail(f"backend {name} is selected by {ENV} but cannot be loaded: {e}")
        pytest.skip(f"backend {name} not available: {e}")


@pytest.fixture
def xp(backend):
    return backend.xp
