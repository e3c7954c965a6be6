"""The ``torch_sdpa_segments`` kernel: packed documents as one torch flash call per
document, on the CPU.

A ``documents`` mask (alone, or ``&`` ``causal()``, ``key_lengths``,
``query_lengths``) is block diagonal: each run of equal ids attends only its own
document's keys (``_segments``). This kernel runs torch's CPU flash kernel (the one
behind ``scaled_dot_product_attention``) once per run, full or causal, and writes each
result into its rows, so a call costs about its visible pairs, as flash-attn's varlen
functions do. torch's own flash backward gives the gradients of ``query``, ``key`` and
``value``; the log-sum-exp's gradient joins through a second backward call per
segment, whose ``dS = P * dlse`` comes from zero values and an output chosen so that
``rowsum(dO * O) = -dlse``. Grouped-query heads are read in place by torch's kernel;
``Dv != D`` pads the narrower side with zeros (which change no score).

The segments come from the ids' values on the host, so the kernel refuses calls whose
values cannot be read now (torch.compile): dispatch then picks another kernel. A call
whose ids are not block diagonal (a document's keys split in two runs) runs on the
portable flash kernel instead, with its backward.

Its priority (120) puts it ahead of ``torch_flex`` (110) and ``torch_sdpa`` (100) for
these calls: measured on a 2-core CPU (bench/test_torch_masks.py), it takes a fraction
of compiled FlexAttention's forward time and gives the CPU a backward flex lacks.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import TYPE_CHECKING, Any, ClassVar

from portattn.autograd import attach_for, flash_forward
from portattn.kernel import Kernel

from ._availability import aten_ops_missing, torch_unavailable
from ._segments import KINDS, Plan, Segment, plan_of, supported_structure
from ._translate import as_4d, scores_may_overflow

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

_HALF = ("float16", "bfloat16")


class TorchSegmentsKernel(Kernel):
    """Packed documents on the CPU: torch's flash kernel once per document."""

    name = "torch_sdpa_segments"
    namespaces = frozenset({"torch"})
    devices = frozenset({"cpu"})
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})
    masks = KINDS
    gqa = value_head_dim = empty = True
    returns_lse = grad = True
    # torch's CPU flash kernel lets a hidden NaN through 0 * NaN inside a causal
    # segment; dispatch checks the output on the CPU.
    finite_inputs_only = True
    priority = 120

    documents_only: ClassVar[bool] = True
    """Dispatch leaves calls without a ``documents`` mask to ``torch_sdpa`` and
    ``tiled`` (the kernel computes them too, one segment per batch element, and runs
    them when named)."""

    @classmethod
    def check_available(cls) -> str | None:
        return torch_unavailable() or aten_ops_missing(
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward")

    @classmethod
    def not_supported_reasons(cls, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        why = supported_structure(inputs.mask)
        if why is not None:
            reasons.append(why)
        if not inputs.values_readable:
            reasons.append("values not readable now (traced or compiled): the segments "
                           "come from the ids' values")
        if "causal" in inputs.mask_kinds and not inputs.scale > 0:
            reasons.append(f"scale={inputs.scale} <= 0 with causal (torch's CPU flash "
                           "kernel gives NaN)")
        if inputs.requires_grad and (inputs.q_len == 0 or inputs.kv_len == 0):
            reasons.append(f"gradients of an empty call (Lq={inputs.q_len}, "
                           f"Lk={inputs.kv_len}): its zeros would carry none")
        return reasons

    @classmethod
    def dispatch_reasons(cls, inputs: AttentionInputs) -> list[str]:
        if cls.documents_only and "documents" not in inputs.mask_kinds:
            return ["no documents mask (torch_sdpa runs the rest; segments pay off for "
                    "packed documents)"]
        return []

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        out, lse = segments_attention(inputs)
        return out, lse if inputs.return_lse else None, None



def segments_attention(inputs: AttentionInputs) -> tuple[Any, Any]:
    """``(out, lse)`` of ``inputs``, one flash call per segment (the portable flash
    kernel when the ids are not block diagonal)."""
    import torch

    batch = inputs.batch_shape
    lead = (*batch, inputs.num_heads, inputs.q_len)
    q, k, v = inputs.query, inputs.key, inputs.value
    if inputs.q_len == 0 or inputs.kv_len == 0:
        out = torch.zeros((*lead, inputs.value_head_dim), dtype=q.dtype, device=q.device)
        lse = torch.full(lead, -math.inf, dtype=_lse_dtype(q.dtype), device=q.device)
        return out, lse
    plan = plan_of(inputs)
    if plan is None:
        if inputs.requires_grad:
            return attach_for("torch")(inputs)
        return flash_forward(inputs)
    dtype = q.dtype
    if scores_may_overflow(inputs):  # bfloat16 scores beyond float32: run in float32
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = (as_4d(x, batch) for x in (q, k, v))
    d, dv = inputs.head_dim, inputs.value_head_dim
    if d < dv:  # torch's kernel wants one head size: zeros change no score
        q, k = (torch.nn.functional.pad(x, (0, dv - d)) for x in (q, k))
    elif dv < d:
        v = torch.nn.functional.pad(v, (0, d - dv))
    call = _Call(plan, inputs.scale)
    if inputs.requires_grad:
        out, lse = _Segments.apply(q, k, v, call)
    else:
        out, lse = _forward(q, k, v, call)
    out = out[..., :dv].reshape(*lead, dv).to(dtype)
    return out, lse.reshape(lead)


def _lse_dtype(dtype: Any) -> Any:
    import torch

    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _Call:
    """What the autograd node keeps besides tensors."""

    def __init__(self, plan: Plan, scale: float) -> None:
        self.plan = plan
        self.scale = scale


def _mask(segment: Segment, dtype: Any) -> Any:
    """The float mask of a segment that needs one (see :attr:`Segment.needs_mask`)."""
    if not segment.needs_mask:
        return None
    import torch

    nq, nk = segment.q1 - segment.q0, segment.k1 - segment.k0
    mask = torch.zeros((nq, nk), dtype=dtype)
    if segment.shift is not None:
        hidden = torch.ones((nq, nk), dtype=torch.bool).triu(segment.shift + 1)
        mask = mask.masked_fill(hidden, -math.inf)
    return mask


def _joined(pieces: list[tuple[int, int, Any]], length: int, like: Any, fill: float) -> Any:
    """The ``(rows, H, length, ...)`` tensor holding each ``(start, stop, piece)`` along
    dim 2 and ``fill`` elsewhere: the pieces joined with gaps when they are disjoint
    (one copy), else summed into a filled tensor (``fill`` 0)."""
    import torch

    pieces = sorted(pieces, key=lambda p: p[0])
    shape = list(like.shape)

    def gap(n: int) -> Any:
        shape[2] = n
        return torch.full(shape, fill, dtype=like.dtype)

    if all(a[1] <= b[0] for a, b in itertools.pairwise(pieces)):
        parts, at = [], 0
        for start, stop, piece in pieces:
            if start > at:
                parts.append(gap(start - at))
            parts.append(piece)
            at = stop
        if at < length or not parts:
            parts.append(gap(length - at))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    joined = gap(length)
    for start, stop, piece in pieces:
        joined[:, :, start:stop] += piece
    return joined


def _cut(x: Any, rows: slice, start: int, stop: int) -> Any:
    """``x[rows, :, start:stop]``, sliced only along the axes it cuts: a slice of a whole
    axis is an alias, which torch's legacy batching (gradcheck's batched gradients)
    cannot follow through a backward."""
    if range(*rows.indices(x.shape[0])) != range(x.shape[0]):
        x = x[rows]
    return x if (start, stop) == (0, x.shape[2]) else x[:, :, start:stop]


def _by_group(call: _Call, per_group: Any) -> Any:
    """``per_group(rows, segments)`` of each group, joined along the batch."""
    import torch

    results = [per_group(rows, segments) for rows, segments in call.plan.groups]
    if len(results) == 1:
        return results[0]
    return tuple(torch.cat(parts, dim=0) for parts in zip(*results, strict=True))


def _forward(q: Any, k: Any, v: Any, call: _Call) -> tuple[Any, Any]:
    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    lse_like = torch.empty((), dtype=_lse_dtype(q.dtype))

    def group(rows: slice, segments: tuple[Segment, ...]) -> tuple[Any, Any]:
        outs, lses = [], []
        for s in segments:
            o, m = flash(q[rows, :, s.q0:s.q1], k[rows, :, s.k0:s.k1],
                         v[rows, :, s.k0:s.k1], 0.0, s.is_causal,
                         attn_mask=_mask(s, q.dtype), scale=call.scale)
            outs.append((s.q0, s.q1, o))
            lses.append((s.q0, s.q1, m))
        like = q[rows, :, :0]
        return (_joined(outs, q.shape[2], like, 0.0),
                _joined(lses, q.shape[2], lse_like.expand(*like.shape[:3]), -math.inf))

    return _by_group(call, group) if call.plan.groups else (
        torch.zeros(q.shape, dtype=q.dtype),
        torch.full(q.shape[:-1], -math.inf, dtype=lse_like.dtype))


def _backward(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, dlse: Any,
              call: _Call) -> tuple[Any, Any, Any]:
    import torch

    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def group(rows: slice, segments: tuple[Segment, ...]) -> tuple[Any, Any, Any]:
        dqs, dks, dvs = [], [], []
        for s in segments:
            qs, ks, vs = (_cut(x, rows, s.q0, s.q1) if x is q else _cut(x, rows, s.k0, s.k1)
                          for x in (q, k, v))
            os, ls = _cut(out, rows, s.q0, s.q1), _cut(lse, rows, s.q0, s.q1)
            mask = _mask(s, q.dtype)
            gq = gk = gv = None
            if dout is not None:
                gq, gk, gv = flash_backward(_cut(dout, rows, s.q0, s.q1), qs, ks, vs, os, ls,
                                            0.0, s.is_causal, attn_mask=mask,
                                            scale=call.scale)
            if dlse is not None:
                # d lse_i / d s_ij = p_ij: the backward's dS = P * (dP - D) with dP = 0
                # (zero values) and D = rowsum(dO * O) = -dlse (dO = e_0, O = -dlse e_0)
                unit = torch.zeros_like(os)
                unit[..., 0] = 1
                shown = unit * (-_cut(dlse, rows, s.q0, s.q1)[..., None]).to(os.dtype)
                lq, lk, _ = flash_backward(unit, qs, ks, torch.zeros_like(vs), shown, ls,
                                           0.0, s.is_causal, attn_mask=mask,
                                           scale=call.scale)
                gq, gk = (lq, lk) if gq is None else (gq + lq, gk + lk)
                gv = torch.zeros_like(vs) if gv is None else gv
            dqs.append((s.q0, s.q1, gq))
            dks.append((s.k0, s.k1, gk))
            dvs.append((s.k0, s.k1, gv))
        return (_joined(dqs, q.shape[2], q[rows, :, :0], 0.0),
                _joined(dks, k.shape[2], k[rows, :, :0], 0.0),
                _joined(dvs, v.shape[2], v[rows, :, :0], 0.0))

    if dout is None and dlse is None:  # neither output reached the loss
        return None, None, None
    if not call.plan.groups:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _by_group(call, group)


def _function() -> type:
    import torch

    class Segments(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, call: _Call) -> tuple[Any, Any]:
            out, lse = _forward(q, k, v, call)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.call = call
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx: Any, dout: Any, dlse: Any) -> tuple[Any, ...]:
            q, k, v, out, lse = ctx.saved_tensors
            return (*_backward(q, k, v, out, lse, dout, dlse, ctx.call), None)

    return Segments


class _Lazy:
    """The autograd Function, defined on first use (importing the plugin imports no
    torch)."""

    @functools.cached_property
    def function(self) -> type:
        return _function()

    def apply(self, *args: Any) -> Any:
        return self.function.apply(*args)


_Segments = _Lazy()
