"""PyTorch's ``scaled_dot_product_attention`` as portattn kernels.

- ``torch_sdpa``: torch tensors on any device, with autograd and dropout.
- ``torch_sdpa_dlpack``: NumPy (CPU), CuPy and JAX arrays borrowed into torch through
  DLPack without copies; the result comes back in the caller's library.
- :func:`from_torch_state_dict` / :func:`to_torch_state_dict`: a
  :class:`portattn.MultiHeadAttention` from and to an ``nn.MultiheadAttention``'s weights.

Importing this package does not import torch; the kernels do when they run.
"""

from __future__ import annotations

from ._dlpack_kernel import TorchSDPADLPackKernel
from ._sdpa_kernel import TorchSDPAKernel
from ._state_dict import from_torch_state_dict, to_torch_state_dict

__all__ = ["TorchSDPADLPackKernel", "TorchSDPAKernel", "from_torch_state_dict",
           "to_torch_state_dict"]
