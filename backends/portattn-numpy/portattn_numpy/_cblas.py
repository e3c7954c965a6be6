"""NumPy's own BLAS matrix products, for compiled loops to call without the GIL.

NumPy does not export its BLAS, but the library is loaded, and threadpoolctl (which
``_threads`` uses to hold it to one thread per call) knows its path. A compiled loop
can call its CBLAS ``gemm`` by address, as NumPy's ``matmul`` does, with
no Python between the calls.

Only the 64-bit-integer interface is used, under the names that say so: NumPy's wheels
bundle OpenBLAS as ``scipy_cblas_sgemm64_`` (``scipy-openblas64``), and OpenBLAS built
with ``INTERFACE64`` and a ``64_`` suffix exports ``cblas_sgemm64_``. A plain
``cblas_sgemm`` may take 32- or 64-bit integers, and the wrong guess would read
garbage dimensions, so under any other name (Accelerate, MKL, a 32-bit OpenBLAS) the
kernel keeps NumPy's ``matmul``.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from ._threads import blas_library_paths

__all__ = ["gemm_address"]

#: The ILP64 CBLAS names of each function, by dtype, the preferred first.
SYMBOLS = {
    ("gemm", np.dtype(np.float32)): ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
    ("gemm", np.dtype(np.float64)): ("scipy_cblas_dgemm64_", "cblas_dgemm64_"),
}


def gemm_address(dtype: np.dtype[Any]) -> int | None:
    """The address of ``cblas_?gemm`` with 64-bit integers for ``dtype`` in a BLAS
    library this process has loaded, or None."""
    return _address("gemm", np.dtype(dtype))


@functools.cache
def _address(function_name: str, dtype: np.dtype[Any]) -> int | None:
    names = SYMBOLS.get((function_name, dtype), ())
    for path in blas_library_paths():
        try:
            library = ctypes.CDLL(path)  # already loaded: the same handle
        except OSError:
            continue
        for name in names:
            function = getattr(library, name, None)
            if function is not None:
                return ctypes.cast(function, ctypes.c_void_p).value
    return None
