"""Both kernels against the float64 reference, over the kit's cases."""

from __future__ import annotations

import pytest
from portattn_torch import TorchSDPADLPackKernel, TorchSDPAKernel

from portattn.testing import check_case, conformance_cases, get_backend


@pytest.mark.parametrize("case", conformance_cases(TorchSDPAKernel), ids=str)
def test_torch_sdpa(case, backend):
    check_case(TorchSDPAKernel, case, backend)


# Borrowing is about the other libraries, whichever backends the run selects for torch.
@pytest.mark.parametrize("library", ["numpy", "jax", "cupy"])
@pytest.mark.parametrize("case", conformance_cases(TorchSDPADLPackKernel), ids=str)
def test_torch_sdpa_dlpack(case, library):
    try:
        backend = get_backend(library)
    except ImportError as e:
        pytest.skip(f"{library} not available: {e}")
    check_case(TorchSDPADLPackKernel, case, backend)
