"""A fused flash-attention forward kernel in Triton, registered with portattn.

Importing this package imports neither torch nor Triton; the kernel module compiles
on first use. Set ``TRITON_INTERPRET=1`` before the first import to run the kernel on
CPU torch tensors through Triton's interpreter (slow; for testing).
"""

from __future__ import annotations

from ._configs import Config, pick_config
from ._kernel import TritonFlashKernel
from ._launch import flash_forward

__all__ = ["Config", "TritonFlashKernel", "flash_forward", "pick_config"]
