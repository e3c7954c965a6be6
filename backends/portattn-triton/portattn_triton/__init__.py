"""A fused flash-attention kernel in Triton, forward and backward, registered with
portattn.

Importing this package imports neither torch nor Triton; the kernel modules compile
on first use. Set ``TRITON_INTERPRET=1`` before the first import to run the kernels on
CPU torch tensors through Triton's interpreter (slow; for testing).
"""

from __future__ import annotations

from ._autograd import flash_attention
from ._configs import (
    BackwardConfig,
    Config,
    autotune_candidates,
    decode_config,
    pick_backward_config,
    pick_config,
)
from ._kernel import TritonFlashKernel
from ._launch import PATHS, flash_forward, pick_path
from ._launch_backward import flash_backward

__all__ = ["PATHS", "BackwardConfig", "Config", "TritonFlashKernel", "autotune_candidates",
           "decode_config", "flash_attention", "flash_backward", "flash_forward",
           "pick_backward_config", "pick_config", "pick_path"]
