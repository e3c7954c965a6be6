"""The conformance kit on numpy_fast: default tiles, and tiny tiles on both paths."""

from __future__ import annotations

import pytest
from portattn_numpy import NumpyFastKernel

from portattn.testing import check_case, conformance_cases, get_backend

CASES = conformance_cases(NumpyFastKernel)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conformance(case, backend):
    check_case(NumpyFastKernel, case, backend)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conformance_tiny_tiles(case, path, tiny_tiles):
    # many query tiles and key blocks: online accumulation, rescaling, mask chunks
    check_case(NumpyFastKernel, case, get_backend("numpy"))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conformance_threaded(case, threads, tiny_tiles):
    threads(3)
    check_case(NumpyFastKernel, case, get_backend("numpy"))
