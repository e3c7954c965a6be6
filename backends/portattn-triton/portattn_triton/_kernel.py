"""The ``triton_flash`` kernel: capabilities and the bridge from portattn's inputs.

Torch tensors go to the Triton kernels as they are, through a torch autograd function
(gradients for query, key, value, bias and a score change's tables, of the output and
the lse); CuPy and JAX
arrays cross over through DLPack (zero copy, forward only) and the results come back
as the caller's array type. The kernels read the mask through its block form, so every
kind is taken (see ``_plan``), and score changes whose entries follow the distance
``j - i`` as one row per head (see ``_distance``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

from portattn.kernel import Kernel
from portattn.masks import KINDS, is_positional

from ._distance import KINDS as DISTANCE_KINDS

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs, PagedInputs

__all__ = ["TritonFlashKernel"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


#: Read once, at import: Triton's decorators read the variable when the kernel module
#: is imported, so a later change would not take effect anyway.
INTERPRET = _interpreting()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


class TritonFlashKernel(Kernel):
    """Exact flash attention fused in Triton kernels, with a FlashAttention-2 backward
    (deterministic: no atomics) for torch autograd."""

    name = "triton_flash"
    namespaces = frozenset({"torch", "cupy", "jax"})
    devices = frozenset({"cuda", "cpu"}) if INTERPRET else frozenset({"cuda"})
    dtypes = frozenset({"float16", "bfloat16", "float32"})
    head_dim = (16, 256)
    masks = frozenset(KINDS)
    bias = softcap = gqa = value_head_dim = empty = True
    returns_lse = grad = dropout = dropout_seed = True
    score_mod = DISTANCE_KINDS  # one row per head, read at each tile's diagonals
    paged = True  # query tiles x key splits through the block table (._triton_paged)
    priority = 200

    @classmethod
    def check_available(cls) -> str | None:
        for module in ("torch", "triton"):
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        if INTERPRET:
            return None
        import torch

        return None if torch.cuda.is_available() else "no CUDA device"

    @classmethod
    def not_supported_reasons(cls, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        if inputs.requires_grad:
            reasons.extend(_gradient_reasons(inputs))
        reasons.extend(_heavy_reasons(inputs))
        if inputs.device == "cpu" and inputs.dtype == "bfloat16":
            reasons.append("dtype=bfloat16 on cpu (the Triton interpreter's bfloat16 dot "
                           "is inexact)")
        if inputs.device == "cuda" and "torch" in sys.modules:
            index = getattr(inputs.device_obj, "index", None)
            if isinstance(index, int):
                major, minor = _capability(index)
                if major < 8:
                    reasons.append(f"compute capability {major}.{minor} < 8.0")
        return reasons

    @classmethod
    def defers_to(cls, inputs: AttentionInputs) -> tuple[str, ...]:
        """On torch's CUDA, the kernels a torch user already has: SDPA for the calls it
        runs with a fused backend, FlexAttention for other masks. The evidence this
        plugin ships (``evidence.json``, from the GPU check) says where triton_flash
        was measured faster, and dispatch then runs it."""
        if inputs.namespace != "torch" or inputs.device != "cuda":
            return ()
        if _sdpa_fuses(inputs):
            return ("torch_sdpa",)
        return ("torch_flex",) if inputs.mask is not None else ()

    @classmethod
    def paged_reasons(cls, call: PagedInputs) -> list[str]:
        from ._launch_paged import paged_rows_limit

        reasons = super().paged_reasons(call)
        if call.namespace != "torch":
            reasons.append(f"namespace={call.namespace} (paged calls: torch)")
            return reasons  # the rest reads torch's shapes and dtypes
        traced = call.host_plan_reason()  # the tiles are planned on the host
        if traced is not None:
            reasons.append(traced)
        if call.device == "cpu" and call.dtype == "bfloat16":
            reasons.append("dtype=bfloat16 on cpu (the Triton interpreter's bfloat16 dot "
                           "is inexact)")
        low, high = cls.head_dim
        dims = (call.query.shape[2], call.value_pages.shape[-1])
        if not all(low <= dim <= high for dim in dims):
            reasons.append(f"head dims {dims} outside [{low}, {high}]")
        elif call.dtype in cls.dtypes and not paged_rows_limit(call):
            reasons.append(f"dtype={call.dtype} with head dims {dims} (no paged tile "
                           "without register spills)")
        if call.mask is not None and not is_positional(call.mask):
            reasons.append(f"mask {call.mask!r} is not made of causal and window parts")
        return reasons

    def run_paged(self, call: PagedInputs) -> tuple[Any, Any]:
        from ._launch_paged import paged_forward

        return paged_forward(call)

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        from ._autograd import attention
        from ._distance import by_distance
        from ._plan import MaskPlan, bias_view

        to_torch = _to_torch(inputs.namespace)
        with _caller_stream(inputs.namespace):
            q, k, v = (to_torch(a) for a in (inputs.query, inputs.key, inputs.value))
            bias = None if inputs.bias is None else to_torch(inputs.bias)
            distance = None if inputs.score_mod is None else by_distance(
                inputs.score_mod, inputs.xp, inputs.q_len, inputs.kv_len, to_torch, q.device)
            plan = MaskPlan(inputs.mask, inputs.xp, inputs.device_obj, to_torch, q.device,
                            inputs.batch_shape, inputs.num_heads, inputs.num_kv_heads,
                            inputs.q_len, inputs.kv_len, None if bias is None else bias_view(
                                bias, inputs.batch_shape, inputs.num_heads, inputs.q_len,
                                inputs.kv_len), distance)
            out, lse = attention(q, k, v, plan, bias=bias, scale=inputs.scale,
                                 softcap=inputs.softcap, dropout=_dropout(inputs, to_torch))
            if inputs.namespace != "torch":
                out = inputs.xp.from_dlpack(out)
                lse = inputs.xp.from_dlpack(lse) if inputs.return_lse else None
        return out, lse if inputs.return_lse else None, None


def _dropout(inputs: AttentionInputs, to_torch: Any) -> Any:
    """The call's :class:`~._triton_dropout.Dropout` (its seed word, drawn from torch's
    generator when the call has no seed), or None."""
    if not inputs.dropout_p:
        return None
    from portattn import dropout

    from ._triton_dropout import Dropout

    return Dropout(to_torch(dropout.seed_word(inputs)), inputs.dropout_p)


def _gradient_reasons(inputs: AttentionInputs) -> list[str]:
    from ._configs import BACKWARD_MAX_DIM, DISTANCE_BACKWARD_MAX_DIM_FLOAT32

    reasons = []
    if inputs.namespace != "torch":
        # The backward is wired to torch autograd only; JAX/CuPy would need their own.
        reasons.append(f"gradients on namespace={inputs.namespace} not supported "
                       "(torch autograd only)")
    dim = max(inputs.head_dim, inputs.value_head_dim)
    limit = BACKWARD_MAX_DIM[2 if inputs.dtype in ("float16", "bfloat16") else 4]
    if dim > limit:
        reasons.append(f"gradients with dtype={inputs.dtype} and head_dim={dim} > {limit} "
                       "not supported")
    if (inputs.score_mod is not None and inputs.dtype == "float32"
            and dim > DISTANCE_BACKWARD_MAX_DIM_FLOAT32):  # no registers left
        reasons.append(f"gradients with dtype=float32, head_dim={dim} > "
                       f"{DISTANCE_BACKWARD_MAX_DIM_FLOAT32} and a score change not supported")
    return reasons


def _sdpa_fuses(inputs: AttentionInputs) -> bool:
    """Whether torch's SDPA runs the call with a fused (flash) backend: half precision,
    one head dim up to 256, no mask or causal on a square call, nothing else added to
    the scores."""
    square_causal = inputs.mask_kinds == {"causal"} and inputs.q_len == inputs.kv_len
    return (inputs.dtype in ("float16", "bfloat16")
            and inputs.head_dim == inputs.value_head_dim <= 256
            and (inputs.mask is None or square_causal)
            and inputs.bias is None and inputs.softcap is None
            and inputs.alibi_slopes is None and inputs.sinks is None
            and inputs.score_mod is None)


def _heavy_reasons(inputs: AttentionInputs) -> list[str]:
    """float32 at the widest head dims has no registers left for a bias, a score
    change, dropout or bit tiles."""
    from ._configs import HEAVY_MAX_DIM_FLOAT32
    from ._plan import FORMULA_KINDS

    dim = max(inputs.head_dim, inputs.value_head_dim)
    if inputs.dtype != "float32" or dim <= HEAVY_MAX_DIM_FLOAT32:
        return []
    what = [] if inputs.bias is None else ["a bias"]
    what += [] if inputs.score_mod is None else ["a score change"]
    what += ["dropout"] if inputs.dropout_p else []
    what += [f"mask {kind}" for kind in sorted(inputs.mask_kinds - FORMULA_KINDS)]
    return [f"dtype=float32 with head_dim={dim} > {HEAVY_MAX_DIM_FLOAT32} and {w} not "
            "supported" for w in what]


def _caller_stream(namespace: str) -> Any:
    """CuPy arrays: run on CuPy's current stream, so the kernels are ordered with the
    caller's work there (DLPack then has nothing to synchronise)."""
    import contextlib

    if namespace != "cupy" or INTERPRET:
        return contextlib.nullcontext()
    import cupy
    import torch

    ptr = cupy.cuda.get_current_stream().ptr
    if ptr == 0:  # the legacy default stream, which torch's default stream is too
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(ptr))


def _to_torch(namespace: str) -> Any:
    if namespace == "torch":
        return lambda x: x
    import torch

    return torch.from_dlpack
