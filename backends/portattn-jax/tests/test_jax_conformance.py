"""The conformance kit on ``jax_dpa``: every declared capability against the float64
reference (cases for other libraries skip)."""

from __future__ import annotations

import pytest
from portattn_jax import JaxDpaKernel

from portattn.testing import check_case, conformance_cases


@pytest.mark.parametrize("case", conformance_cases(JaxDpaKernel), ids=str)
def test_conformance(case, backend):
    check_case(JaxDpaKernel, case, backend)
