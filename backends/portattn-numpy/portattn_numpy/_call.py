"""Running one call: the rule for non-finite values, then its plan (``_plan``) on the
threads (``_threads``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._plan import build, hides_any_pair, useful_threads
from ._strategy import work
from ._threads import get_num_threads, run_parallel

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

    from ._config import Config

__all__ = ["attend"]


def attend(inputs: AttentionInputs, config: Config, tile_bytes: int) -> tuple[Any, Any]:
    """``(out, lse)`` of the call, planned with ``config`` and score tiles of
    ``tile_bytes``."""
    if not hides_any_pair(inputs, config):
        # every row weighs every value: NaN or inf among them reaches exactly the
        # rows that see them, and no pass over the values (a decode step's whole
        # cost) is needed to know it; a mask that hides nothing (causal, one
        # decode step) is not applied either
        return _attend(inputs._replace(mask=None), config, tile_bytes)
    finite = np.isfinite(inputs.value)
    if finite.all():  # the usual case: one pass over the values to know it
        return _attend(inputs, config, tile_bytes)
    # A masked key has weight exactly 0, but 0 * NaN is NaN: attend the values with
    # their non-finite entries zeroed, then find the rows that attend a key that held
    # one: zero queries give every key the mask and bias allow the same weight, so
    # a column marking those keys gets weight in exactly those rows (also where the
    # real weight underflowed to 0), which are NaN.
    clean = np.where(finite, inputs.value, 0)
    out, lse = _attend(inputs._replace(value=clean), config, tile_bytes)
    marks = (~finite).any(axis=-1, keepdims=True).astype(inputs.value.dtype)
    bias = inputs.bias
    hits, _ = _attend(inputs._replace(
        query=np.zeros_like(inputs.query), value=marks, value_head_dim=1,
        return_lse=False, softcap=None,
        bias=None if bias is None else np.where(bias == -np.inf, bias, np.zeros_like(bias))),
        config, tile_bytes)
    out[np.broadcast_to(hits > 0, out.shape)] = np.nan
    return out, lse


def _attend(inputs: AttentionInputs, config: Config, tile_bytes: int) -> tuple[Any, Any]:
    threads = get_num_threads()  # a bad PORTATTN_NUMPY_THREADS fails here, clearly
    plan = build(inputs, config, tile_bytes, threads)
    p, strategy, units = plan.problem, plan.strategy, plan.units
    if units:
        run_parallel(lambda queue: work(p, config, strategy, plan.careful, queue), units,
                     useful_threads(plan, config, threads),
                     first=lambda: strategy.prepare(p, units))
    return p.out, p.lse
