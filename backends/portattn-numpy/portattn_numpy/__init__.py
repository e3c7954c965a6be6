"""portattn-numpy: a threaded, cache-tiled NumPy CPU kernel for portattn.

Installing the distribution registers the ``numpy_fast`` kernel; portattn then uses it
for NumPy float32 and float64 arrays. ``set_num_threads`` / ``get_num_threads`` (or the
``PORTATTN_NUMPY_THREADS`` environment variable) set how many threads it uses;
``configured(...)`` changes its tile sizes and strategies for a block (``Config``).
"""

from __future__ import annotations

from ._config import Config, configured
from ._kernel import NumpyFastKernel
from ._threads import THREADS_ENV, get_num_threads, set_num_threads

__all__ = ["THREADS_ENV", "Config", "NumpyFastKernel", "configured", "get_num_threads",
           "set_num_threads"]
