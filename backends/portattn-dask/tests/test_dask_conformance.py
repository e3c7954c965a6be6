"""The conformance kit over ``dask_blockwise`` on the threaded scheduler."""

from __future__ import annotations

import pytest
from portattn_dask import DaskBlockwiseKernel

from portattn.testing import check_case, conformance_cases
from portattn.testing.plugin import require_library

dask = require_library("dask")

CASES = conformance_cases(DaskBlockwiseKernel)


@pytest.fixture(autouse=True, scope="module")
def threaded():
    with dask.config.set(scheduler="threads"):
        yield


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conformance(case, backend):
    # the test suite's dask backend: whatever chunks dask picks for small arrays
    check_case(DaskBlockwiseKernel, case, backend)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conformance_chunked(case, chunked):
    # split over batch, heads, query and key lengths, and the head dim
    check_case(DaskBlockwiseKernel, case, chunked)
