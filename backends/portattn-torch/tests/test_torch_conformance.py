"""Both kernels against the float64 reference, over the kit's cases."""

from __future__ import annotations

import pytest
from portattn_torch import TorchSDPADLPackKernel, TorchSDPAKernel

from portattn.testing import check_case, conformance_cases
from portattn.testing.plugin import require_backend


@pytest.mark.parametrize("case", conformance_cases(TorchSDPAKernel), ids=str)
def test_torch_sdpa(case, backend):
    check_case(TorchSDPAKernel, case, backend)


# Borrowing is about the other libraries: these are cross-library tests, run where the
# other library is selected too (the ``cross`` tox env: numpy and torch), and failed
# there, not skipped, when it is missing.
@pytest.mark.cross
@pytest.mark.parametrize("library", ["numpy", "jax", "cupy"])
@pytest.mark.parametrize("case", conformance_cases(TorchSDPADLPackKernel), ids=str)
def test_torch_sdpa_dlpack(case, library):
    require_backend("torch")  # the kernel's own library must be there as well
    check_case(TorchSDPADLPackKernel, case, require_backend(library))
