"""What one rank computes for its visible pairs: the forward through
:func:`portattn.attention` (any kernel) merged exactly by log-sum-exp, and the
backward of each pair from the merged output and lse (FlashAttention-2: the pair's
probabilities are ``exp(s - lse)`` with the *whole* row's lse, so no pair needs the
others)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import array_api_extra as xpx
from array_api_compat import device as device_of

from .._call import attention
from .._inputs import describe
from .._kernels import flash_backward
from .._lib import dtype_name

if TYPE_CHECKING:
    from ._plan import Pair, Problem

__all__ = ["Partials", "add_pair_grads", "backward_step", "compute_dtype", "forward_step",
           "zeros_like_shard"]


def compute_dtype(xp: Any, dtype: Any) -> Any:
    """float32 for half precision, the dtype itself otherwise."""
    return xp.float32 if dtype_name(dtype) in ("float16", "bfloat16") else dtype


def _rows(x: Any, rows: slice) -> Any:
    return x[..., rows, :]


class Partials:
    """The running ``(out, lse)`` of a rank's whole query shard, in the compute dtype,
    into which each pair's result merges as key blocks arrive: in place where the
    library allows, into accumulators allocated once (no list of parts, no
    concatenation at the end)."""

    def __init__(self, problem: Problem, query: Any) -> None:
        self.problem, self.query = problem, query
        self.ct = compute_dtype(problem.xp, query.dtype)
        self.out: Any = None
        self.lse: Any = None

    def _start(self, dv: int) -> None:
        xp, q = self.problem.xp, self.query
        rows = tuple(q.shape[:-1])
        self.out = xp.zeros((*rows, dv), dtype=self.ct, device=device_of(q))
        self.lse = xp.full(rows, -float("inf"), dtype=self.ct, device=device_of(q))

    def add(self, pair: Pair, key: Any, value: Any) -> None:
        xp = self.problem.xp
        ks, qs = pair.key.local, pair.query.local
        out, lse = attention(_rows(self.query, qs), _rows(key, ks), _rows(value, ks),
                             mask=pair.mask, return_lse=True, **self.problem.options)
        if self.out is None:
            self._start(value.shape[-1])
        out, lse = xp.astype(out, self.ct, copy=False), xp.astype(lse, self.ct, copy=False)
        # The merge of two parts (portattn.merge), into the pair's rows: each part
        # weighs exp(its lse - the total lse).
        before = self.lse[..., qs]
        total = xp.logaddexp(before, lse)
        # a row no key has reached has total -inf: both weights are then exp(-inf) = 0
        empty = xp.isinf(total) & (total < 0)
        shift = xp.where(empty, xp.zeros_like(total), total)
        self.out = xpx.at(self.out)[..., qs, :].multiply(xp.exp(before - shift)[..., None])
        self.out = xpx.at(self.out)[..., qs, :].add(out * xp.exp(lse - shift)[..., None])
        self.lse = xpx.at(self.lse)[..., qs].set(total)

    def result(self, dv: int) -> tuple[Any, Any]:
        """``(out, lse)`` of the rank's whole shard: padding rows and rows that see no
        key give 0 and ``-inf``."""
        if self.out is None:
            self._start(dv)
        return self.out, self.lse


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
