"""portattn-jax: JAX's fused dot-product attention as the portattn kernel ``jax_dpa``.

The package also makes portattn's masks JAX pytrees, so a mask can be an argument of a
``jax.jit``-compiled function. That happens on import when JAX is already imported
(importing this package never imports JAX: portattn loads every plugin, also for NumPy
calls), and at the latest on the first JAX call dispatched; call
:func:`register_mask_pytrees` to do it explicitly.
"""

from __future__ import annotations

import sys

from ._autograd import attach_autograd
from ._flash_kernel import JaxFlashKernel
from ._kernel import JaxDpaKernel
from ._pytree import register_mask_pytrees

__all__ = ["JaxDpaKernel", "JaxFlashKernel", "attach_autograd", "register_mask_pytrees"]

__version__ = "0.1.0"

if "jax" in sys.modules:
    register_mask_pytrees()
