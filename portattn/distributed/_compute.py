"""What one rank computes for its visible pairs: the forward through
:func:`portattn.attention` (any kernel) merged exactly by log-sum-exp, and the
backward of each pair from the merged output and lse (FlashAttention-2: the pair's
probabilities are ``exp(s - lse)`` with the *whole* row's lse, so no pair needs the
others)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import array_api_extra as xpx
from array_api_compat import device as device_of

from .._api import attention
from .._flash_backward import flash_backward
from .._inputs import describe, dtype_name
from .._merge import merge

if TYPE_CHECKING:
    from ._layout import Segment
    from ._plan import Pair, Problem

__all__ = ["Partials", "add_pair_grads", "backward_step", "compute_dtype", "forward_step",
           "placed", "zeros_like_shard"]


def compute_dtype(xp: Any, dtype: Any) -> Any:
    """float32 for half precision, the dtype itself otherwise."""
    return xp.float32 if dtype_name(dtype) in ("float16", "bfloat16") else dtype


def _rows(x: Any, rows: slice) -> Any:
    return x[..., rows, :]


class Partials:
    """The running ``(out, lse)`` of each query segment of a rank, in the compute
    dtype, merged pair by pair as key blocks arrive."""

    def __init__(self, problem: Problem, query: Any) -> None:
        self.problem, self.query = problem, query
        self.ct = compute_dtype(problem.xp, query.dtype)
        self.acc: dict[int, tuple[Any, Any]] = {}

    def add(self, pair: Pair, key: Any, value: Any) -> None:
        xp = self.problem.xp
        ks = pair.key.local
        out, lse = attention(_rows(self.query, pair.query.local), _rows(key, ks),
                             _rows(value, ks), mask=pair.mask, return_lse=True,
                             **self.problem.options)
        out, lse = xp.astype(out, self.ct, copy=False), xp.astype(lse, self.ct, copy=False)
        before = self.acc.get(pair.query.start)
        if before is not None:
            out, lse = merge([before[0], out], [before[1], lse])
        self.acc[pair.query.start] = (out, lse)

    def result(self, dv: int) -> tuple[Any, Any]:
        """``(out, lse)`` of the rank's whole shard: padding rows and rows that see no
        key give 0 and ``-inf``."""
        xp, q = self.problem.xp, self.query
        layout = self.problem.queries
        lead = tuple(q.shape[:-2])
        segments = layout.segments(self.problem.rank)
        outs = {s.start: a[0] for s, a in ((s, self.acc.get(s.start)) for s in segments)
                if a is not None}
        lses = {s.start: a[1] for s, a in ((s, self.acc.get(s.start)) for s in segments)
                if a is not None}
        out = placed(xp, outs, segments, layout.shard_length, (*lead, dv), self.ct,
                     device_of(q), fill=0.0)
        lse = placed(xp, {k: v[..., None] for k, v in lses.items()}, segments,
                     layout.shard_length, (*lead, 1), self.ct, device_of(q),
                     fill=-float("inf"))
        return out, lse[..., 0]


def placed(xp: Any, parts: dict[int, Any], segments: tuple[Segment, ...], length: int,
           shape: tuple[int, ...], dtype: Any, device: Any, fill: float = 0.0) -> Any:
    """A shard ``(*shape[:-1], length, shape[-1])`` holding ``parts[segment.start]``
    at each segment's local rows and ``fill`` elsewhere."""
    pieces, filled = [], 0
    lead, last = shape[:-1], shape[-1]

    def gap(n: int) -> Any:
        return xp.full((*lead, n, last), fill, dtype=dtype, device=device)

    for seg in segments:
        part = parts.get(seg.start)
        if part is None:
            continue
        if seg.offset > filled:
            pieces.append(gap(seg.offset - filled))
        pieces.append(xp.astype(part, dtype, copy=False))
        filled = seg.offset + len(seg)
    if length > filled or not pieces:
        pieces.append(gap(length - filled))
    return pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=-2)


def zeros_like_shard(xp: Any, like: Any, dtype: Any) -> Any:
    """A zero accumulator shaped like the shard ``like``, in ``dtype``."""
    return xp.zeros(like.shape, dtype=dtype, device=device_of(like))


def add_pair_grads(problem: Problem, pair: Pair, query: Any, key: Any, value: Any,
                   out: Any, lse: Any, dout: Any, dlse: Any,
                   grads: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """``grads`` (dq of the rank's whole query shard, dk and dv of the pair's whole key
    and value shards, in the compute dtype) with the pair's gradients added, given the
    rank's merged ``out`` and ``lse`` and their cotangents: in place where the library
    allows (the pair's rows of each accumulator are what its backward adds into, so no
    gradient of the pair's own is ever allocated), functionally elsewhere."""
    qs, ks = pair.query.local, pair.key.local
    xp = problem.xp
    # Half precision: the pair's gradients stay float32 (the tiled backward computes in
    # float32 anyway; rounding each pair's part to half would add one rounding per rank).
    ct = compute_dtype(xp, query.dtype)
    q, k, v = (xp.astype(x, ct, copy=False)
               for x in (_rows(query, qs), _rows(key, ks), _rows(value, ks)))
    inputs = describe(q, k, v, mask=pair.mask, **problem.options)
    rows = (qs, ks, ks)
    views = tuple(_rows(g, r) for g, r in zip(grads, rows, strict=True))
    got = flash_backward(inputs, _rows(out, qs), lse[..., qs], _rows(dout, qs),
                         None if dlse is None else dlse[..., qs], into=views)
    # a view the backward added to in place is already in its accumulator
    return tuple(g if new is view else xpx.at(g)[..., r, :].set(new)
                 for g, r, view, new in zip(grads, rows, views, got[:3], strict=True))


def forward_step(problem: Problem, source: int, query: Any, key: Any,
                 value: Any) -> tuple[Any, Any]:
    """``(out, lse)`` of this rank's whole query shard over the key shard of ``source``
    (compute dtype; rows that see none of it give 0 and ``-inf``): one step of a
    schedule whose engine merges steps itself."""
    partials = Partials(problem, query)
    for pair in problem.pairs(source):
        partials.add(pair, key, value)
    return partials.result(value.shape[-1])


def backward_step(problem: Problem, source: int, query: Any, key: Any, value: Any,
                  out: Any, lse: Any, dout: Any, dlse: Any) -> tuple[Any, Any, Any]:
    """This rank's gradient parts of one step, whole shards in the compute dtype: of
    its query shard, and of the key and value shards of ``source``."""
    xp = problem.xp
    ct = compute_dtype(xp, query.dtype)
    grads = tuple(zeros_like_shard(xp, a, ct) for a in (query, key, value))
    for pair in problem.pairs(source):
        grads = add_pair_grads(problem, pair, query, key, value, out, lse, dout, dlse,
                               grads)
    return grads
