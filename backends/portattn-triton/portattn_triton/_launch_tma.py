"""Host side of the tensor-descriptor (TMA) forward.

Descriptors are built on the host (``triton.tools.tensor_descriptor``), so no device
allocator is needed.
"""

from __future__ import annotations

import math
from typing import Any

from ._configs import Config

__all__ = ["launch_tma", "tma_reasons"]


def tma_reasons(*tensors: Any) -> list[str]:
    """Why these ``(Z, H, L, D)`` tensors cannot travel through tensor descriptors
    (empty when they can): a unit inner stride, 16-byte aligned base and strides."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return ["this triton has no host-side tensor descriptors"]
    reasons = []
    for name, t in zip(("query", "key", "value"), tensors, strict=False):
        size = t.element_size()
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            reasons.append(f"{name}.stride(-1)={t.stride(-1)} (descriptors need 1)")
        strides = _strides(t)[:-1]
        if any(s * size % 16 for s in strides):
            reasons.append(f"{name} strides {strides} are not 16-byte aligned")
        if t.data_ptr() % 16:
            reasons.append(f"{name} is not 16-byte aligned")
    return reasons


def _strides(t: Any) -> list[int]:
    # A size-1 dimension is never stepped along: any aligned stride describes it.
    return [16 // t.element_size() if n == 1 else s for n, s in zip(t.shape, t.stride(),
                                                                     strict=True)]


def _descriptor(t: Any, rows: int, cols: int) -> Any:
    from triton.tools.tensor_descriptor import TensorDescriptor

    strides = _strides(t)
    strides[-1] = 1
    return TensorDescriptor(t, list(t.shape), strides, [1, 1, rows, cols])


def launch_tma(q: Any, k: Any, v: Any, o: Any, lse: Any, common: tuple, factors: tuple,
               flags: dict, config: Config) -> None:
    """Launch the tensor-descriptor kernel on ``(Z, H, L, D)`` views; ``common`` holds
    its arguments from ``KeyLengths`` to ``kv_len``, ``factors`` the four after them,
    ``flags`` the compile-time ones with the block sizes."""
    from ._triton_tma import flash_forward_tma_kernel

    z, hq, lq = q.shape[0], q.shape[1], q.shape[2]
    bd, bdv = flags["BLOCK_D"], flags["BLOCK_DV"]
    descs = (_descriptor(q, config.block_m, bd), _descriptor(k, config.block_n, bd),
             _descriptor(v, config.block_n, bdv), _descriptor(o, config.block_m, bdv))
    flash_forward_tma_kernel[(z * hq * math.ceil(lq / config.block_m),)](
        *descs, lse, *common, *factors, **flags, WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps, num_stages=config.num_stages)
