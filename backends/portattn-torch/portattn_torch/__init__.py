"""PyTorch's ``scaled_dot_product_attention`` as portattn kernels.

- ``torch_sdpa``: torch tensors on any device, with autograd and dropout.
- ``torch_flex``: torch tensors through compiled FlexAttention, reading portattn's block
  form: every mask kind, skipping the tiles it hides; softcap and bias; CPU (forward)
  and CUDA (with lse and gradients).
- ``torch_sdpa_segments``: packed documents (``documents`` masks, with ``causal``,
  ``key_lengths``, ``query_lengths``) on the CPU, torch's flash kernel once per
  document, forward and backward.
- ``torch_sdpa_local``: a sliding window joined to global tokens on the CPU (forward
  and log-sum-exp): the window, the global keys and the global rows, merged.
- ``torch_sdpa_dlpack``: NumPy (CPU), CuPy and JAX arrays borrowed into torch through
  DLPack without copies; the result comes back in the caller's library.
- :func:`from_torch_state_dict` / :func:`to_torch_state_dict`: a
  :class:`portattn.MultiHeadAttention` from and to an ``nn.MultiheadAttention``'s weights.

Importing this package does not import torch; the kernels do when they run.
"""

from __future__ import annotations

from ._dlpack_kernel import TorchSDPADLPackKernel
from ._flex_kernel import TorchFlexKernel
from ._local_kernel import TorchLocalKernel
from ._sdpa_kernel import TorchSDPAKernel
from ._segments_kernel import TorchSegmentsKernel
from ._state_dict import from_torch_state_dict, to_torch_state_dict

__all__ = ["TorchFlexKernel", "TorchLocalKernel", "TorchSDPADLPackKernel", "TorchSDPAKernel",
           "TorchSegmentsKernel", "from_torch_state_dict", "to_torch_state_dict"]
