"""portattn kernel for Dask arrays.

``dask_blockwise`` turns one attention call on Dask arrays into a lazy graph of
per-chunk attention calls, each run by the best kernel for the chunk's own array
type (NumPy, CuPy, ...), so the work spreads over threads or a ``dask.distributed``
cluster. Nothing is computed until the result is.
"""

from __future__ import annotations

from ._kernel import DaskBlockwiseKernel

__all__ = ["DaskBlockwiseKernel"]
