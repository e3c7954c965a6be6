"""The kernel's declarations: importable and checkable without importing dask."""

from __future__ import annotations

import subprocess
import sys

import portattn


def test_registered_under_its_name():
    entry = next(e for e in portattn.kernels() if e.name == "dask_blockwise")
    assert entry.kernel is not None
    assert entry.distribution == "portattn-dask"


def test_declarations_and_availability_import_no_dask():
    code = ("import sys; from portattn_dask import DaskBlockwiseKernel as K; "
            "assert K.available() is None; print('dask' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
