"""Every installed kernel, plus two baselines, timed over the sweep grid.

Cases come from the kernel registry (a new plugin appears without edits) crossed with
backends, sequence lengths, masks and dtypes; see ``conftest.py`` and ``README.md`` for
how to choose them. Each benchmark records its FLOP count, GFLOP/s and peak memory in
``extra_info``; cases are grouped by (device, dtype, mask, L) so each group compares
like with like.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from portattn_bench.measure import peak_memory

if TYPE_CHECKING:
    from portattn_bench.cases import Case, SweepConfig
    from portattn_bench.sweep import History, Inputs


def test_attention(sweep_case: Case, sweep_config: SweepConfig, sweep_history: History,
                   sweep_inputs: Inputs, benchmark: Any) -> None:
    case = sweep_case
    skip = sweep_history.skip_reason(case)
    if skip is not None:
        pytest.skip(f"{case}: {skip}")
    q, k, v = sweep_inputs.get(case)
    why = case.runner.reasons(case.backend, q, k, v, case.causal)
    if why:
        pytest.skip(f"{case}: {'; '.join(why)}")
    call = case.runner.prepare(case.backend, q, k, v, case.causal)

    def once() -> Any:
        return case.backend.wait(call())

    benchmark.group = f"{case.backend.device} {case.dtype} mask={case.mask} L={case.length}"
    benchmark.extra_info.update(
        runner=case.runner.name, kind=case.runner.kind, backend=str(case.backend),
        dtype=case.dtype, mask=case.mask, length=case.length, flops=case.flops)
    try:
        result = benchmark.pedantic(once, rounds=sweep_config.repeat,
                                    warmup_rounds=sweep_config.warmup, iterations=1)
        memory, method = peak_memory(call, case.backend.wait, case.backend.memory)
    except Exception:
        sweep_history.fail(case)
        raise
    assert tuple(result.shape) == (*tuple(q.shape[:-1]), v.shape[-1])
    benchmark.extra_info.update(peak_memory_bytes=memory, memory_method=method)
    stats = getattr(benchmark.stats, "stats", None)  # None with --benchmark-disable
    if stats is not None:
        benchmark.extra_info["gflops"] = case.flops / stats.min / 1e9
        sweep_history.add(case, stats.min, memory)
