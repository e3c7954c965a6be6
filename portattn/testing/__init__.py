"""Testing tools for portattn and its kernel plugins.

- :func:`conformance_cases` / :func:`check_case`: check a kernel against the float64
  reference over cases generated from its declared capabilities.
- :mod:`portattn.testing.plugin`: pytest fixtures ``backend`` and ``xp`` that run a test
  on every installed array library (load with
  ``pytest_plugins = ["portattn.testing.plugin"]``).
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
