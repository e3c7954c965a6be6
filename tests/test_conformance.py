"""The conformance kit over the built-in kernels and every kernel installed."""

from __future__ import annotations

import pytest

import portattn
from portattn._reference import ReferenceKernel
from portattn._tiled import TiledKernel
from portattn.testing import check_case, check_kernel, conformance_cases


@pytest.mark.parametrize("case", conformance_cases(ReferenceKernel), ids=str)
def test_reference(case, backend):
    check_case(ReferenceKernel, case, backend)


@pytest.mark.parametrize("case", conformance_cases(TiledKernel), ids=str)
def test_tiled(case, backend):
    check_case(TiledKernel, case, backend)


@pytest.mark.parametrize("block", [(3, 5), (16, 4)], ids=lambda b: f"blocks{b[0]}x{b[1]}")
@pytest.mark.parametrize("case", [c for c in conformance_cases(TiledKernel)
                                  if c.mask and c.dtype == "float32"], ids=str)
def test_tiled_small_blocks(case, block, backend, monkeypatch):
    # Many tiles per call: exercises skipping, partial tiles and the online softmax.
    import portattn._tiled as tiled

    monkeypatch.setattr(tiled, "block_sizes", lambda inputs: block)
    check_case(TiledKernel, case, backend)


def _plugin_kernels():
    return [e.kernel for e in portattn.kernels()
            if e.kernel is not None and e.distribution != "portattn"]


@pytest.mark.parametrize("kernel", _plugin_kernels(), ids=lambda k: k.name)
def test_installed_plugin_kernels(kernel, backend):
    check_kernel(kernel, backend)
