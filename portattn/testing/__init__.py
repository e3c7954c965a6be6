"""Testing tools for portattn and its kernel plugins.

- :func:`conformance_cases` / :func:`check_case`: check a kernel against the float64
  reference over cases generated from its declared capabilities.
- :func:`get_backend` / :data:`BACKEND_NAMES`: the one list of array libraries (and
  devices) that the tests, the demo and the benchmark report share.
- :mod:`portattn.testing.plugin`: the one pytest harness of every suite: fixtures
  ``backend`` and ``xp`` that run a test on every selected array library (import them
  into a ``conftest.py``, or load ``pytest_plugins = ["portattn.testing.plugin"]`` from
  a top-level one), and ``require_backend`` / ``require_library`` for tests that need a
  particular one. ``PORTATTN_TEST_BACKENDS`` selects; selected and missing fails.
- :mod:`portattn.testing.paged`: sequences' keys and values scattered over a page pool,
  for tests of paged kernels.
"""

from __future__ import annotations

from .backends import BACKEND_NAMES, Backend, get_backend, to_numpy
from .conformance import Case, check_case, check_kernel, conformance_cases
from .oracle import assert_close, oracle, tolerance

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "Case",
    "assert_close",
    "check_case",
    "check_kernel",
    "conformance_cases",
    "get_backend",
    "oracle",
    "to_numpy",
    "tolerance",
]
