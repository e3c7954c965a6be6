"""The conformance kit over the built-in kernels and the example plugin's kernel.

Every other plugin runs the kit over its own kernels in its own suite
(``backends/*/tests/test_*_conformance.py``), one test per case.
"""

from __future__ import annotations

import os

import pytest

from portattn._kernels import ReferenceKernel, TiledKernel
from portattn.testing import check_case, conformance_cases

try:  # tests/example_plugin; test_environment.py fails a tox env that lacks it
    from portattn_example import EinsumKernel
except ImportError:
    EinsumKernel = None


@pytest.mark.parametrize("case", conformance_cases(ReferenceKernel), ids=str)
def test_reference(case, backend):
    check_case(ReferenceKernel, case, backend)


@pytest.mark.parametrize("case", conformance_cases(TiledKernel), ids=str)
def test_tiled(case, backend):
    check_case(TiledKernel, case, backend)


#: Both tile shapes by default; ``PORTATTN_TILED_BLOCKS=16x4`` keeps one, where each tile
#: costs a compile (JAX) or a graph (Dask). 16 x 4 runs every line that 3 x 5 runs, and
#: one more; the ``long`` tox env runs both shapes on every library.
BLOCKS = [tuple(int(n) for n in b.split("x"))
          for b in os.environ.get("PORTATTN_TILED_BLOCKS", "3x5,16x4").split(",")]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"blocks{b[0]}x{b[1]}")
@pytest.mark.parametrize("case", [c for c in conformance_cases(TiledKernel)
                                  if c.mask and c.dtype == "float32"], ids=str)
def test_tiled_small_blocks(case, block, backend, monkeypatch):
    # Many tiles per call: exercises skipping, partial tiles and the online softmax.
    import portattn._kernels._tiled as tiled

    monkeypatch.setattr(tiled, "block_sizes", lambda inputs: block)
    check_case(TiledKernel, case, backend)


@pytest.mark.parametrize("case", conformance_cases(EinsumKernel) if EinsumKernel else [],
                         ids=str)
def test_example_plugin(case, backend):
    check_case(EinsumKernel, case, backend)
