"""The ``torch_flex`` kernel: torch tensors through compiled FlexAttention.

portattn's block form becomes flex's ``BlockMask`` (tiles of :attr:`TorchFlexKernel.block`,
128 by default) and the mask's ``allows`` its ``mask_mod``, so every mask kind runs and
the tiles it hides are skipped; ``softcap``, a ``bias`` (read with its broadcast
strides, never copied) and ALiBi (``alibi_slopes``, computed per score, never
materialised) join through ``score_mod``; grouped-query attention through
``enable_gqa``. On CUDA it returns the log-sum-exp and has flex's own backward; torch's
compiled CPU flex (2.13) is forward only and gives no log-sum-exp, so there those
calls go to other kernels.

flex_attention is compiled once per process and kind of call (``_flex_compile``): the
first call of a kind compiles (seconds; logged at INFO on the ``portattn`` logger),
later calls reuse it whatever their lengths.

Dispatch: its priority (110) sits above ``torch_sdpa`` (100), and it leaves to SDPA
(or, for what SDPA lacks, to ``tiled``) what they run faster, a preference
(:meth:`TorchFlexKernel.dispatch_reasons`) that ``kernel="torch_flex"`` overrides:

- calls SDPA runs with no mask tensor (no mask, a bias alone, top-left causal or
  causal with ``Lq == Lk``, torch's lower-right causal on an accelerator), unless
  they need ``softcap`` or ``return_lse``, which SDPA lacks;
- ``dense`` masks, which SDPA reads as they are (flex would read every pair on the
  host to find the hidden tiles, and again in every partial tile);
- calls of fewer than :attr:`TorchFlexKernel.min_scores` scores (batch x heads x
  ``Lq * Lk``; 8 x 512 x 512 on a CPU, 8 x 8192 x 8192 on CUDA), where compiled flex
  does not pay for itself (see :data:`MIN_SCORES`).

So masks that hide tiles SDPA would compute (packed documents, windows, global or sink
tokens, chunks, block layouts, prefixes, padding ranges, mask functions, unions) run
here above that size. All of it follows from the call's description.

Non-finite inputs follow the README's rule (``_flex_nonfinite``): on the CPU a call
with NaN or inf inputs (or scores that could overflow), and every call under
torch.compile, runs on the portable flash kernel instead, since torch's CPU flex loses
NaN scores; on CUDA keys that are not finite are set to 0 and scored NaN, which the
mask hides or lets through to the row.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, ClassVar

from portattn import masks
from portattn.autograd import flash_forward
from portattn.kernel import Kernel, dtype_name
from portattn.masks import KINDS

from ._availability import torch_unavailable
from ._flex_compile import compile_settings, compiled_flex
from ._flex_mods import block_mask_of, score_mod_of
from ._flex_nonfinite import bad_key_scores, portable_instead
from ._translate import as_4d, structured_form

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

#: Kinds holding arrays as long as the call: static tensors on the CPU (``_flex_mods``).
_CALL_LENGTH_KINDS = frozenset({"documents", "dense", "block_layout", "global_tokens"})

#: Below this many scores (batch x heads x Lq x Lk), SDPA with a mask tensor or
#: ``tiled`` is as fast as compiled flex or faster, whose calls carry a fixed cost
#: (the block form, its tables, guards). On a 2-core CPU at (1, 8, L, 64) float32,
#: flex took 0.7x SDPA's time with packed documents at L = 512 and 1.8x at L = 256;
#: 0.9x tiled's with softcap at L = 512. On an H200 at (1, 8, L, 64) bfloat16 with
#: packed documents, where the fixed cost dominates, 1.6x SDPA's at L = 4096 and 0.46x
#: at L = 16384 (a first run gave 2.8x there): the threshold sits between, at 8192.
MIN_SCORES = {"cpu": 8 * 512 * 512, "cuda": 8 * 8192 * 8192}


class TorchFlexKernel(Kernel):
    """Compiled FlexAttention over portattn's block form, on CPU (forward) and CUDA."""

    name = "torch_flex"
    namespaces = frozenset({"torch"})
    devices = frozenset({"cpu", "cuda"})
    # torch's CPU flex takes these three; float64 runs on tiled (or SDPA)
    dtypes = frozenset({"float16", "bfloat16", "float32"})
    head_dim = (16, 256)
    masks = frozenset(KINDS)  # the block form and allows: every kind
    score_functions = True  # flex's own score_mod
    bias = softcap = alibi = gqa = value_head_dim = empty = True
    returns_lse = grad = True  # on CUDA; refused on the CPU (see the module's docstring)
    # torch does not promise a deterministic flex backward
    deterministic = False
    priority = 110

    block: ClassVar[int] = 128
    """Tile side of the block form flex reads."""
    min_scores: ClassVar[dict[str, int]] = MIN_SCORES
    """Per device, dispatch leaves calls with fewer scores (batch x heads x Lq x Lk)
    to other kernels (0: none)."""
    leaves_sdpa_calls: ClassVar[bool] = True
    """Dispatch leaves the calls SDPA runs faster to it (see the module's docstring)."""

    @classmethod
    def check_available(cls) -> str | None:
        return torch_unavailable() or _flex_unavailable()

    @classmethod
    def not_supported_reasons(cls, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        if inputs.device == "cpu":
            if inputs.return_lse:
                reasons.append("return_lse on cpu (torch's compiled CPU flex_attention "
                               "gives no log-sum-exp)")
            if inputs.requires_grad:
                reasons.append("gradients on cpu (torch's compiled CPU flex_attention is "
                               "forward only)")
            reasons += _cpu_length_reasons(inputs, cls.block)
        if inputs.requires_grad and (inputs.q_len == 0 or inputs.kv_len == 0):
            reasons.append(f"gradients of an empty call (Lq={inputs.q_len}, "
                           f"Lk={inputs.kv_len}): its zeros would carry none")
        reasons += _bias_reasons(inputs) + _function_reasons(inputs)
        if not reasons:  # the costlier question last, once the call is otherwise ours
            why = _device_unsupported(inputs.device)
            if why is not None:
                reasons.append(why)
        return reasons

    @classmethod
    def notes(cls, inputs: AttentionInputs) -> list[str]:
        from ._flex_compile import entries

        notes = [f"compiles flex_attention on the first call of each kind of call (mask "
                 f"structure, dtype, heads, score changes): seconds; {entries()} kinds "
                 "compiled in this process so far"]
        per_length = sorted(inputs.mask_kinds & _CALL_LENGTH_KINDS)
        if inputs.device == "cpu" and (per_length or inputs.bias is not None):
            what = ", ".join([*per_length, *(["bias"] if inputs.bias is not None else [])])
            notes.append(f"on the CPU, with {what}, it compiles again for each new length")
        return notes

    @classmethod
    def dispatch_reasons(cls, inputs: AttentionInputs) -> list[str]:
        """The calls other kernels run faster (see the module's docstring): dispatch
        passes it over for them; named, it runs them."""
        reasons = []
        scores = math.prod(inputs.batch_shape) * inputs.num_heads * inputs.q_len * inputs.kv_len
        least = cls.min_scores.get(inputs.device, 0)
        if scores < least:
            reasons.append(f"{scores} scores < {least} on {inputs.device} (SDPA or tiled "
                           "is faster on small calls)")
        if cls.leaves_sdpa_calls:
            if "dense" in inputs.mask_kinds:
                reasons.append("dense mask (SDPA reads it as it is)")
            elif (inputs.softcap is None and inputs.alibi_slopes is None
                  and inputs.score_mod is None and not inputs.return_lse):
                if inputs.mask is None:
                    reasons.append("no mask: SDPA runs it as it is")
                elif structured_form(inputs) is not None:
                    reasons.append(f"mask {inputs.mask!r}: SDPA runs it without a mask "
                                   "tensor")
        return reasons

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        if portable_instead(inputs):  # the rule for non-finite inputs, on the CPU
            out, lse = flash_forward(inputs)
        else:
            out, lse = flex_attention(inputs, self.block)
        return out, lse if inputs.return_lse else None, None


def _bias_reasons(inputs: AttentionInputs) -> list[str]:
    bias = inputs.bias
    if bias is None:
        return []
    reasons = []
    name = dtype_name(bias.dtype)
    if name not in (inputs.dtype, "float32"):
        reasons.append(f"bias dtype={name} with dtype={inputs.dtype} (flex adds a "
                       f"float32 or {inputs.dtype} bias)")
    lead = tuple(bias.shape[:len(inputs.batch_shape)])
    if len(set(lead)) > 1 and 1 in lead:
        reasons.append(f"bias batch shape {lead} broadcast along some batch dims only "
                       "(it would be copied)")
    return reasons


@functools.cache
def _function_reasons(inputs: AttentionInputs) -> list[str]:
    """flex calls a score function one score at a time: one that returns more (it
    broadcasts an array over the heads instead of indexing it with ``h``) would make
    flex read out of bounds, so it is asked once, with one score. Gradients for its
    arrays would come from flex's gradients of captured tensors, which this kernel
    leaves to ``tiled`` (summed tile by tile in a fixed order there)."""
    import torch

    change = inputs.score_mod
    if change is None:
        return []
    with torch.no_grad():
        one = torch.zeros((), device=inputs.device_obj)
        index = torch.zeros((), dtype=torch.int64, device=inputs.device_obj)
        shape = tuple(change.fn(one, index, index, index, index, *change.arrays).shape)
    if shape:
        return [f"{change!r} gives shape {shape} for one score (flex calls it one score "
                "at a time: index per-head arrays with h)"]
    if any(getattr(a, "requires_grad", False) for a in change.arrays):
        return [f"gradients of the arrays of {change!r} (tiled sums them deterministically)"]
    return []


def _flex_unavailable() -> str | None:
    import inspect

    try:
        from torch.nn.attention import flex_attention as flex
    except ImportError:
        return "torch has no torch.nn.attention.flex_attention"
    if "seq_lengths" not in inspect.signature(flex.BlockMask.from_kv_blocks).parameters:
        return "torch's flex_attention is too old (BlockMask.from_kv_blocks has no seq_lengths)"
    import torch

    # Asked for the first time while torch.compile traces (which cannot trace the
    # question): dynamo runs, so it is supported.
    if not torch.compiler.is_compiling() and not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python"
    return None


_device_checks: dict[str, str | None] = {}


def _device_unsupported(device: str) -> str | None:
    """Why compiled flex cannot run on ``device`` here, checked once per device (a
    plain dict, which torch.compile reads as it traces; it cannot trace the check)."""
    import torch

    if device not in _device_checks:
        if torch.compiler.is_compiling():
            return (f"flex on {device} was not checked before torch.compile traced this "
                    "call (one eager call checks it)")
        _device_checks[device] = _check_device(device)
    return _device_checks[device]


def _check_device(device: str) -> str | None:
    import torch

    if device == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "cuda without triton (flex compiles to triton)"
    import os
    import sys

    if (sys.platform == "darwin" or not torch.cpu._is_avx2_supported()
            or os.environ.get("ATEN_CPU_CAPABILITY") == "default"):
        return "cpu without avx2 (torch's CPU flex template needs it)"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # inductor raises its own error types for a missing compiler
        return f"no C++ compiler for torch.compile on cpu ({type(e).__name__})"
    return None


def flex_attention(inputs: AttentionInputs, block: int) -> tuple[Any, Any]:
    """``(out, lse)`` of ``inputs`` (torch tensors) by compiled flex; ``lse`` is None
    unless asked for."""
    import torch

    q, k, v = inputs.query, inputs.key, inputs.value
    batch = inputs.batch_shape
    lead = (*batch, inputs.num_heads, inputs.q_len)
    if inputs.q_len == 0 or inputs.kv_len == 0:
        out = torch.zeros((*lead, inputs.value_head_dim), dtype=q.dtype, device=q.device)
        lse = torch.full(lead, -math.inf, dtype=torch.float32, device=q.device)
        return out, lse if inputs.return_lse else None
    q, k, v = (as_4d(x, batch) for x in (q, k, v))
    bad_keys = None
    if inputs.device != "cpu" and not inputs.assume_finite and (
            inputs.mask is not None or inputs.bias is not None):
        # nothing is read off the CPU: the rule for non-finite inputs on the device
        k, v, bad_keys = bad_key_scores(inputs, k, v)
    bias = None if inputs.bias is None else _flat_bias(inputs.bias, batch)
    alibi = None if inputs.alibi_slopes is None else _alibi(inputs)
    # torch's CPU template: no tensor's size may reach the mods (see _flex_mods)
    static = inputs.device == "cpu"
    block_mask, counts_shape, captured = block_mask_of(inputs, block, static)
    static_shapes = None
    if static:
        captured += [t for t in (bias, bad_keys, *(alibi or ()), *_function_arrays(inputs))
                     if t is not None]
        for t in captured:
            torch._dynamo.mark_static(t)
        static_shapes = tuple(tuple(t.shape) for t in captured)
    score_mod = score_mod_of(inputs.softcap, bias, bad_keys, alibi, inputs.score_mod)
    kind = (*_kind(inputs, bad_keys is not None, block),
            _specialised((q, k, v), counts_shape), static_shapes)
    entry = compiled_flex(kind, _label(inputs))
    with compile_settings(grad=inputs.requires_grad):
        out, lse = entry(q, k, v, score_mod, block_mask, inputs.scale,
                         inputs.num_heads != inputs.num_kv_heads, inputs.return_lse)
    out = out.reshape(*lead, inputs.value_head_dim)
    if lse is not None:
        lse = lse.reshape(lead)
    return out, lse


def _flat_bias(bias: Any, batch: tuple[int, ...]) -> Any:
    """``(*batch | 1, H | 1, Lq | 1, Lk | 1)`` as ``(B | 1, ...)``; a view unless the
    bias is not contiguous across its batch dims."""
    lead = tuple(bias.shape[:len(batch)])
    rows = 1 if all(n == 1 for n in lead) else math.prod(batch)
    return bias.reshape(rows, *bias.shape[len(batch):])


def _alibi(inputs: AttentionInputs) -> tuple[Any, Any]:
    """``(slopes, offset)``: the slopes as float32 ``(B | 1, Hq)`` and the query's
    position offset ``Lk - Lq`` as a 0-d tensor (no symbol reaches the CPU template;
    see ``_flex_mods``)."""
    import torch

    slopes = inputs.alibi_slopes
    lead = tuple(slopes.shape[:-1])
    rows = 1 if all(n == 1 for n in lead) else math.prod(inputs.batch_shape)
    slopes = slopes.reshape(rows, slopes.shape[-1]).to(torch.float32)
    offset = torch.tensor(inputs.kv_len - inputs.q_len, device=inputs.device_obj)
    return slopes, offset


def _kind(inputs: AttentionInputs, guarded: bool, block: int) -> tuple:
    """What decides the code flex generates for a call (see ``_flex_compile``): with
    :func:`_specialised`, what torch compiles again for."""
    bias = inputs.bias
    slopes = inputs.alibi_slopes
    return (inputs.device, inputs.dtype, inputs.num_heads, inputs.num_kv_heads,
            inputs.head_dim, inputs.value_head_dim, inputs.scale,
            _structure(inputs.mask), inputs.softcap,
            None if bias is None else (dtype_name(bias.dtype),
                                       tuple(n == 1 for n in bias.shape[-3:])),
            None if slopes is None else all(n == 1 for n in slopes.shape[:-1]),
            _function_structure(inputs.score_mod),
            inputs.num_heads != inputs.num_kv_heads, inputs.return_lse,
            inputs.requires_grad, guarded, block)


def _function_arrays(inputs: AttentionInputs) -> tuple[Any, ...]:
    return () if inputs.score_mod is None else tuple(inputs.score_mod.arrays)


def _function_structure(change: Any) -> Any:
    """A score function known by its code and its arrays' dtypes and ranks (a new
    closure of the same function compiles nothing new)."""
    if change is None:
        return None
    return (getattr(change.fn, "__code__", type(change.fn)),
            tuple((dtype_name(a.dtype), a.ndim) for a in change.arrays))


def _specialised(arrays: tuple[Any, ...], counts_shape: tuple[int, ...]) -> tuple:
    """What torch specialises even under ``dynamic=True``: sizes of 1 (a batch of one,
    a decode step's single query, a call of one tile) and the inputs' layouts."""
    sizes = (*(a.shape for a in arrays), counts_shape)
    return (tuple(tuple(n == 1 for n in shape) for shape in sizes),
            tuple(a.is_contiguous() for a in arrays))


def _cpu_length_reasons(inputs: AttentionInputs, block: int) -> list[str]:
    """float32 lengths torch 2.13's compiled CPU flex template gets wrong: shorter than
    one block and 8 past a multiple of 16 (8, 24, ..., 120 with tiles of 128). There
    it returned values up to 2.4 off, varying from run to run (memory past the end is
    read), also when called directly; the other lengths checked (1 to 65, every fourth
    to 298, multiples of 16 to 1024, 1000 and 1032) came out right, and so did float16
    and bfloat16."""
    if inputs.dtype != "float32":
        return []
    return [f"{name}={n} on cpu in float32 (shorter than a tile of {block} and 8 past a "
            "multiple of 16: torch's CPU flex template reads past the end there)"
            for name, n in (("Lq", inputs.q_len), ("Lk", inputs.kv_len))
            if n < block and n % 16 == 8]


def _structure(mask: masks.Mask | None) -> Any:
    """A mask's structure, with a mask function known by its code (a new closure of
    the same function compiles nothing new)."""
    if mask is None:
        return None
    if isinstance(mask, (masks.Intersection, masks.Union)):
        return (type(mask), *(_structure(p) for p in mask.members))
    if isinstance(mask, masks.Function):
        return (type(mask), getattr(mask.fn, "__code__", type(mask.fn)),
                None if mask.args is None else len(mask.args))
    return mask.structure()


def _label(inputs: AttentionInputs) -> str:
    parts = [f"mask={inputs.mask!r}"]
    if inputs.softcap is not None:
        parts.append(f"softcap={inputs.softcap}")
    if inputs.bias is not None:
        parts.append("bias")
    if inputs.alibi_slopes is not None:
        parts.append("alibi")
    if inputs.score_mod is not None:
        parts.append(f"score_mod={inputs.score_mod!r}")
    flags = [f for f in ("return_lse", "requires_grad") if getattr(inputs, f)]
    return (f"{inputs.dtype} on {inputs.device}, head_dim={inputs.head_dim}, "
            + ", ".join(parts + flags))
