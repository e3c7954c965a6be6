"""The ``torch_sdpa_dlpack`` kernel: other libraries' arrays through torch's kernels.

NumPy arrays (CPU) and CuPy or JAX arrays are viewed as torch tensors through DLPack
(no copy: torch reads the caller's memory), run through ``torch_sdpa``, and the result
is viewed back as the caller's array type, again without a copy. Its priority sits
below the libraries' own kernels and above the portable ones.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

from portattn import masks
from portattn.kernel import Kernel, jax_tracer_type

from ._availability import torch_unavailable
from ._sdpa_kernel import TorchSDPAKernel, sdpa_attention
from ._translate import bias_reasons

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs
    from portattn.masks import Mask


class TorchSDPADLPackKernel(Kernel):
    """torch's fused attention on NumPy, CuPy or JAX arrays borrowed through DLPack."""

    name = "torch_sdpa_dlpack"
    namespaces = frozenset({"numpy", "cupy", "jax"})
    devices = frozenset({"cpu", "cuda"})
    dtypes = TorchSDPAKernel.dtypes
    masks = TorchSDPAKernel.masks
    bias = gqa = value_head_dim = empty = True
    # Neither torch's autograd nor its RNG belongs to the caller's library.
    dropout = grad = False
    finite_inputs_only = TorchSDPAKernel.finite_inputs_only
    priority = 20

    @classmethod
    def check_available(cls) -> str | None:
        return torch_unavailable()

    @classmethod
    def not_supported_reasons(cls, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        torch = sys.modules.get("torch")
        if torch is not None and not hasattr(torch, "from_dlpack"):
            # another thread is importing it: its module exists, its functions not yet
            reasons.append("torch is still being imported (by another thread)")
        tracer = jax_tracer_type()
        if tracer is not None and isinstance(inputs.query, tracer):
            reasons.append("traced jax arrays (jit, grad, vmap) cannot be borrowed")
        # Byte order is part of a NumPy dtype, so this follows from the description.
        for name, array in _arrays(inputs):
            if not getattr(array.dtype, "isnative", True):
                reasons.append(f"{name} byte order {array.dtype.str} cannot cross DLPack")
        reasons += bias_reasons(inputs)
        return reasons

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        out = sdpa_attention(borrow_inputs(inputs))
        return give_back(out, inputs.xp), None, None


def _arrays(inputs: AttentionInputs) -> list[tuple[str, Any]]:
    named = [("query", inputs.query), ("key", inputs.key), ("value", inputs.value)]
    if inputs.bias is not None:
        named.append(("bias", inputs.bias))
    for part in () if inputs.mask is None else inputs.mask.parts:
        named += [(f"mask {part!r}", a) for a in part.arrays]
    return named


def borrow(x: Any) -> Any:
    """``x`` as a torch tensor sharing its memory.

    Arrays with negative strides (reversed views) are copied first: DLPack cannot
    describe them and torch aborts the process on them instead of raising.
    """
    import torch

    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.generic):  # a NumPy scalar: no DLPack
        x = numpy.asarray(x)
    if any(s < 0 for s in getattr(x, "strides", ())):
        x = x.copy()
    return torch.from_dlpack(x)


def give_back(out: Any, xp: Any) -> Any:
    """The torch result ``out`` as an array of ``xp``, sharing its memory."""
    return xp.from_dlpack(out)


def borrow_mask(mask: Mask | None) -> Mask | None:
    """``mask`` with its arrays (dense mask, lengths) borrowed into torch."""
    return None if mask is None else mask.with_arrays([borrow(a) for a in mask.arrays])


def borrow_inputs(inputs: AttentionInputs) -> AttentionInputs:
    """The same call described on torch tensors that view the caller's arrays."""
    query = borrow(inputs.query)
    mask = inputs.mask
    if mask is not None and "function" in inputs.mask_kinds and inputs.q_len and inputs.kv_len:
        # a mask function is written in the caller's library: evaluated there, once
        lq, lk = inputs.q_len, inputs.kv_len
        allowed = borrow(mask.tile(inputs.xp, 0, lq, 0, lk, lq, lk, inputs.device_obj))
        mask = masks.dense(allowed).bind(_torch_namespace(), inputs.batch_shape,
                                         inputs.num_heads, lq, lk, query.device)
    else:
        mask = borrow_mask(mask)
    return inputs._replace(
        query=query, key=borrow(inputs.key), value=borrow(inputs.value),
        mask=mask, mask_kinds=frozenset() if mask is None else mask.kinds,
        bias=None if inputs.bias is None else borrow(inputs.bias),
        xp=_torch_namespace(), namespace="torch", device_obj=query.device)


@functools.cache
def _torch_namespace() -> Any:
    import torch
    from array_api_compat import array_namespace

    return array_namespace(torch.empty(0))
