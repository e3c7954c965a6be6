"""The conformance kit on numpy_fast: default tiles, and tiny tiles on both paths
with either exponential."""

from __future__ import annotations

import pytest
from portattn_numpy import NumpyFastKernel

from portattn.testing import check_case, conformance_cases, get_backend

CASES = conformance_cases(NumpyFastKernel)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conformance(case, backend):
    check_case(NumpyFastKernel, case, backend)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conformance_tiny_tiles(case, path, exponential, tiny_tiles):
    # many query tiles and key blocks: online accumulation, rescaling, mask chunks; in
    # base 2 and base e
    check_case(NumpyFastKernel, case, get_backend("numpy"))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conformance_threaded(case, threads, tiny_tiles):
    threads(3)
    check_case(NumpyFastKernel, case, get_backend("numpy"))
