"""The ``jax_dpa`` kernel: portattn's contract on top of ``jax.nn.dot_product_attention``.

What JAX cannot honour is declared, so dispatch sends those calls to ``tiled``:

- float64: JAX computes the softmax in float32;
- ``return_lse``: JAX's log-sum-exp is rounded to the input dtype and carries no
  gradient; ``return_weights``, ``softcap`` and dropout have no JAX argument;
- calls whose score matrix is too large for the XLA path, which materialises it (the
  cuDNN path does not): on CPUs from about a million scores on, where ``tiled`` is
  faster, elsewhere where the memory would run out. A preference
  (:meth:`JaxDpaKernel.dispatch_reasons`): ``kernel="jax_dpa"`` runs them.

On a CUDA GPU, half-precision calls whose mask cuDNN expresses without rows left
with no key run ``implementation="cudnn"``; everything else runs XLA.
"""

from __future__ import annotations

import math
import re
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar

from portattn.kernel import ANY, Kernel
from portattn.masks import KINDS

from ._pytree import register_mask_pytrees
from ._translate import fold_mask

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

    from ._translate import MaskSpec

__all__ = ["JaxDpaKernel", "choose_implementation"]

_MIN_JAX = (0, 5)
_CUDNN_DTYPES = ("float16", "bfloat16")
#: cuDNN needs head dims that are multiples of 8, at most 256 (128 before Hopper; JAX
#: checks that when tracing and the kernel then falls back to XLA).
_CUDNN_MAX_HEAD_DIM = 256


class JaxDpaKernel(Kernel):
    """``jax.nn.dot_product_attention`` (XLA everywhere, cuDNN on CUDA GPUs)."""

    name = "jax_dpa"
    namespaces = frozenset({"jax"})
    devices = ANY
    dtypes = frozenset({"float16", "bfloat16", "float32"})
    masks = frozenset(KINDS)
    bias = gqa = value_head_dim = empty = grad = True
    # cuDNN's backward pass may accumulate with atomics on GPUs.
    deterministic = False
    priority = 100

    #: The XLA path materialises ``B * Hq * Lq * Lk`` float32 scores (several times,
    #: with gradients); above this many, ``tiled`` with its O(L * block) memory runs.
    xla_score_limit: ClassVar[int] = 1 << 28
    #: On CPUs the materialised scores also make XLA slower than ``tiled`` (which
    #: keeps its tiles in cache) from about this size on: 8 heads of 362 x 362.
    xla_score_limit_cpu: ClassVar[int] = 1 << 20

    @classmethod
    def check_available(cls) -> str | None:
        # Dispatch asks this for every call, NumPy ones too: look, don't import JAX.
        from importlib.metadata import PackageNotFoundError, version
        from importlib.util import find_spec

        if find_spec("jax") is None:
            return "jax is not installed"
        try:
            installed = version("jax")
        except PackageNotFoundError:
            return None  # importable without metadata (a source checkout): trust it
        release = tuple(int(p) for p in re.findall(r"\d+", installed)[:2])
        if release < _MIN_JAX:
            return (f"jax {installed} is too old (dot_product_attention with "
                    f"local_window_size needs jax>={'.'.join(map(str, _MIN_JAX))})")
        return None

    @classmethod
    def dispatch_reasons(cls, inputs: AttentionInputs) -> list[str]:
        """Calls whose scores the XLA path would materialise beyond its limits: a
        tiled kernel runs them faster (CPUs) or in O(L) memory; named, this kernel
        runs them."""
        spec = fold_mask(inputs)
        device = _device_kind(inputs)
        if choose_implementation(inputs, spec, device == "cuda") != "xla":
            return []
        scores = math.prod(inputs.batch_shape) * inputs.num_heads * inputs.q_len \
            * inputs.kv_len
        cpu = device == "cpu"
        limit = cls.xla_score_limit_cpu if cpu else cls.xla_score_limit
        if scores <= limit:
            return []
        why = "tiled kernels are faster on cpu" if cpu else "O(L^2) memory"
        return [f"score matrix of {scores} elements > {limit} (jax's XLA path "
                f"materialises it: {why})"]

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        import jax.numpy as jnp

        register_mask_pytrees()  # JAX is loaded by now; masks may be jit arguments next
        if inputs.q_len == 0 or inputs.kv_len == 0:
            shape = (*inputs.batch_shape, inputs.num_heads, inputs.q_len, inputs.value_head_dim)
            return jnp.zeros(shape, dtype=inputs.query.dtype), None, None
        spec = fold_mask(inputs)
        implementation = choose_implementation(inputs, spec, _device_kind(inputs) == "cuda")
        if implementation == "cudnn":
            try:
                return _attend(inputs, spec, "cudnn"), None, None
            except (NotImplementedError, ValueError, RuntimeError):
                pass  # a constraint JAX checks when tracing (GPU generation, cuDNN version)
        return _attend(inputs, spec, "xla"), None, None


def choose_implementation(inputs: AttentionInputs, spec: MaskSpec, cuda: bool) -> str:
    """``cudnn`` where cuDNN's flash attention gives portattn's exact answer, else ``xla``.

    cuDNN takes half precision and a top-left causal band (optionally with a left
    window) or none, without dense masks or bias here. Its rows without keys are
    undefined, so the band must leave every row a key, also with key lengths of 1
    (rows with length 0 are zeroed afterwards); query lengths are zeroed afterwards too.
    """
    if not cuda or inputs.dtype not in _CUDNN_DTYPES:
        return "xla"
    head = max(inputs.head_dim, inputs.value_head_dim)
    if head % 8 or head > _CUDNN_MAX_HEAD_DIM:
        return "xla"
    if inputs.bias is not None or spec.has_dense:
        return "xla"
    band = spec.band
    if band is not None:
        if band.right != 0 or band.rows_with_keys(inputs.q_len, inputs.kv_len) != (
                0, inputs.q_len):
            return "xla"
        if spec.key_lengths and band.left is not None:
            return "xla"
    return "cudnn"


def _attend(inputs: AttentionInputs, spec: MaskSpec, implementation: str) -> Any:
    from ._compute import Plan, attend

    if spec.all_rows_have_keys(inputs.q_len, inputs.kv_len) and inputs.bias is None:
        fix_rows = "none"
    elif spec.has_dense or inputs.bias is not None:
        fix_rows = "full"
    else:
        fix_rows = "band"
    plan = Plan(batch_shape=inputs.batch_shape, scale=inputs.scale,
                implementation=implementation, band=spec.band, fix_rows=fix_rows)
    dense = spec.dense_arrays(len(inputs.batch_shape) + 3, inputs.q_len, inputs.kv_len)
    return attend(inputs.query, inputs.key, inputs.value, inputs.bias, dense,
                  spec.key_lengths, spec.query_lengths, plan=plan)


def _device_kind(inputs: AttentionInputs) -> str:
    """``cuda`` (a CUDA GPU, where cuDNN exists), ``cpu`` or another kind. A traced value
    carries no device: it runs where JAX puts computations by default."""
    import jax

    if inputs.device_obj is not None and not isinstance(inputs.query, jax.core.Tracer):
        return _kind(inputs.device_obj)
    return _default_kind()


@cache
def _default_kind() -> str:
    import jax

    try:
        return _kind(jax.devices()[0])
    except RuntimeError:  # no backend could be initialised; nothing will run anyway
        return "cpu"


def _kind(device: Any) -> str:
    platform = getattr(device, "platform", "cpu")
    if platform != "gpu":
        return platform
    # ROCm GPUs report the platform "gpu" as well; cuDNN needs CUDA.
    version = str(getattr(getattr(device, "client", None), "platform_version", ""))
    return "cuda" if "cuda" in version.lower() else "gpu"
