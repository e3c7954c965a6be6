"""Host side of the tensor-descriptor (TMA) forward, and the forward's autotuners.

Descriptors are built on the host (``triton.tools.tensor_descriptor``), so no device
allocator is needed. The autotuners time :func:`~portattn_triton.autotune_candidates`
once per kind of call (head dims, mask flags, precision) and keep the fastest.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from ._configs import Config, autotune_candidates

__all__ = ["autotuned", "launch_tma", "tma_reasons"]

#: Autotuning reruns the kernel per candidate: one kind of call (not one length) each.
_TUNING_KEY = ["BLOCK_D", "BLOCK_DV", "HAS_LOWER", "HAS_UPPER", "HAS_KEY_LENGTHS",
               "HAS_QUERY_LENGTHS", "HAS_POISON", "SOFTCAP", "INPUT_PRECISION"]


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


def _set_block_shapes(nargs: dict) -> None:
    """Autotuner pre-hook: the descriptors' blocks follow the candidate's tile sizes."""
    m, n, d, dv = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_D"], nargs["BLOCK_DV"]
    nargs["DescQ"].block_shape = [1, 1, m, d]
    nargs["DescK"].block_shape = [1, 1, n, d]
    nargs["DescV"].block_shape = [1, 1, n, dv]
    nargs["DescO"].block_shape = [1, 1, m, dv]


def launch_tma(q: Any, k: Any, v: Any, o: Any, lse: Any, optional: tuple, scalars: tuple,
               factors: tuple, flags: dict, config: Config | None,
               tune_for: tuple[int, int] | None) -> None:
    """Launch the tensor-descriptor kernel on ``(Z, H, L, D)`` views; ``config`` None
    means autotune for a device of capability ``tune_for``."""
    from ._triton_tma import flash_forward_tma_kernel

    z, hq, lq = q.shape[0], q.shape[1], q.shape[2]
    bd, bdv = flags["BLOCK_D"], flags["BLOCK_DV"]
    c = config or Config(16, 16, 4, 1)  # placeholder blocks, reset by the pre-hook
    descs = (_descriptor(q, c.block_m, bd), _descriptor(k, c.block_n, bd),
             _descriptor(v, c.block_n, bdv), _descriptor(o, c.block_m, bdv))
    args = (*descs, lse, *optional, *scalars, *factors)
    if config is None:
        kernel = autotuned(flash_forward_tma_kernel, tune_for, q.element_size(),
                           q.shape[-1], v.shape[-1])
        kernel[lambda meta: (z * hq * math.ceil(lq / meta["BLOCK_M"]),)](*args, **flags)
        return
    flash_forward_tma_kernel[(z * hq * math.ceil(lq / config.block_m),)](
        *args, **flags, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps, num_stages=config.num_stages)


@functools.cache
def autotuned(kernel: Any, capability: tuple[int, int] | None, element_bytes: int,
              head_dim: int, value_head_dim: int) -> Any:
    """``kernel`` wrapped in ``triton.autotune`` over the candidates for this device,
    element size and head dims (cached: one autotuner, so one tuning, per kind)."""
    import triton

    tma = "DescQ" in kernel.arg_names
    configs = []
    for c in autotune_candidates(capability, element_bytes, head_dim, value_head_dim):
        meta = {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}
        if tma:
            meta["WARP_SPECIALIZE"] = c.warp_specialize
        configs.append(triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages,
                                     pre_hook=_set_block_shapes if tma else None))
    return triton.autotune(configs=configs, key=_TUNING_KEY)(kernel)
