"""Attention over a large batch: a 2-worker Dask LocalCluster against one NumPy process.

Inputs ``(64, 8, 2048, 64)`` float32 in chunks of 8 batch elements (so 8 blocks), made
on the workers and kept there; the cluster time is building the graph and computing
the result on the workers (not gathering it: a cluster user's next step runs there
too). The baseline is ``portattn.attention`` on the same arrays as NumPy in this
process, whichever kernel the registry picks. Recorded in ``extra_info``: peak
resident memory of each worker during one run (Linux: the kernel's high-water mark,
reset before the run) and above its idle level, and the number of tasks in the graph.

    python -m pytest -c pyproject.toml bench/test_dask.py --benchmark-only
    python bench/test_dask.py            # the same, once, as a table

``PORTATTN_DASK_BENCH_BATCH`` shrinks the batch (a multiple of 8) for a quick look;
``PORTATTN_DASK_BENCH_THREADS`` sets threads per worker (default: half the cores each).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

pytest.importorskip("distributed")

BATCH = int(os.environ.get("PORTATTN_DASK_BENCH_BATCH", "64"))
SHAPE = (BATCH, 8, 2048, 64)
CHUNKS = (8, 8, 2048, 64)
WORKERS = 2
THREADS = int(os.environ.get("PORTATTN_DASK_BENCH_THREADS", "0")) or max(
    1, (os.cpu_count() or 2) // WORKERS)
GROUP = f"dask {SHAPE} float32, chunks of {CHUNKS[0]}"


# --- memory: the resident high-water mark, reset before a run (Linux) -------------
def reset_peak() -> int:
    """Reset this process's peak RSS where the OS allows; return the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def read_peak() -> int:
    """Peak RSS in bytes since :func:`reset_peak` (since start where it cannot reset)."""
    peak = _status("VmHWM")
    if peak:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --- the two ways of running ----------------------------------------------------
def start_cluster() -> tuple[Any, Any]:
    import cloudpickle
    import distributed

    if __name__ != "__main__":  # workers cannot import this file: ship its functions
        cloudpickle.register_pickle_by_value(sys.modules[__name__])

    cluster = distributed.LocalCluster(n_workers=WORKERS, threads_per_worker=THREADS,
                                       processes=True, host="127.0.0.1",
                                       dashboard_address=None)
    return cluster, distributed.Client(cluster)


def cluster_inputs(client: Any) -> tuple[Any, Any, Any]:
    """q, k, v made on the workers and kept there."""
    import dask.array as da
    import distributed

    rng = da.random.default_rng(0)
    arrays = client.persist([rng.standard_normal(SHAPE, dtype="float32", chunks=CHUNKS)
                             for _ in range(3)])
    distributed.wait(arrays)
    return tuple(arrays)


def run_cluster(client: Any, q: Any, k: Any, v: Any) -> None:
    """One run: the result is computed on the workers, then dropped. The graph is the
    same every run (same keys), so the previous result must be gone, or the cluster
    would just hand it back."""
    import distributed

    import portattn

    out = client.persist(portattn.attention(q, k, v))
    distributed.wait(out)
    keys = [f.key for f in distributed.futures_of(out)]
    client.cancel(out)
    del out
    deadline = time.monotonic() + 30
    while any(client.who_has(keys).values()) and time.monotonic() < deadline:
        time.sleep(0.01)


def graph_tasks(q: Any, k: Any, v: Any) -> dict[str, int]:
    import portattn

    out = portattn.attention(q, k, v)
    keys = list(dict(out.__dask_graph__()))
    own = [key for key in keys if str(key[0]).startswith("attention-")]
    return {"graph_tasks": len(keys), "attention_tasks": len(own),
            "kernel": portattn.explain(q, k, v).kernel.name}


def cluster_memory(client: Any, q: Any, k: Any, v: Any) -> dict[str, Any]:
    """Peak RSS of each worker during one run, and its idle RSS before it."""
    idle = client.run(reset_peak)
    run_cluster(client, q, k, v)
    peak = client.run(read_peak)
    return {"worker_peak_bytes": sorted(peak.values()),
            "worker_peak_above_idle_bytes": sorted(peak[w] - idle[w] for w in peak)}


def numpy_memory(q: Any, k: Any, v: Any) -> dict[str, Any]:
    import portattn

    idle = reset_peak()
    out = portattn.attention(q, k, v)
    peak = read_peak()
    del out
    return {"process_peak_bytes": peak, "process_peak_above_idle_bytes": peak - idle,
            "kernel": portattn.explain(q, k, v).kernel.name}


# --- pytest-benchmark -------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    cluster, client = start_cluster()
    with cluster, client:
        yield client


@pytest.fixture(scope="module")
def inputs(client):
    arrays = cluster_inputs(client)
    yield arrays
    del arrays


@pytest.fixture(scope="module")
def numpy_inputs(inputs):
    return tuple(a.compute() for a in inputs)


def test_dask_cluster(benchmark: Any, client: Any, inputs: Any) -> None:
    benchmark.group = GROUP
    benchmark.extra_info.update(workers=WORKERS, threads_per_worker=THREADS,
                                **graph_tasks(*inputs))
    benchmark.pedantic(lambda: run_cluster(client, *inputs), rounds=3, warmup_rounds=1,
                       iterations=1)
    benchmark.extra_info.update(cluster_memory(client, *inputs))


def test_numpy_one_process(benchmark: Any, numpy_inputs: Any) -> None:
    import portattn

    benchmark.group = GROUP
    out = benchmark.pedantic(lambda: portattn.attention(*numpy_inputs), rounds=3,
                             warmup_rounds=1, iterations=1)
    assert out.shape == SHAPE
    del out
    benchmark.extra_info.update(numpy_memory(*numpy_inputs))


# --- as a script: one run of each, as a table ---------------------------------------
def main() -> None:
    import portattn

    mib = 1 << 20
    cluster, client = start_cluster()
    with cluster, client:
        q, k, v = cluster_inputs(client)
        tasks = graph_tasks(q, k, v)
        run_cluster(client, q, k, v)  # warm up: imports and kernel discovery on workers
        start = time.perf_counter()
        run_cluster(client, q, k, v)
        cluster_s = time.perf_counter() - start
        memory = cluster_memory(client, q, k, v)
        arrays = tuple(a.compute() for a in (q, k, v))
    portattn.attention(*(a[:1] for a in arrays))  # warm up
    start = time.perf_counter()
    portattn.attention(*arrays)
    numpy_s = time.perf_counter() - start
    local = numpy_memory(*arrays)
    print(f"{GROUP}: {WORKERS} workers x {THREADS} threads")
    print(f"  cluster ({tasks['kernel']}): {cluster_s:.2f} s, "
          f"{tasks['graph_tasks']} tasks in the graph ({tasks['attention_tasks']} attention)")
    print("  worker peak RSS MiB: "
          + ", ".join(f"{p / mib:.0f} (+{d / mib:.0f} over idle)" for p, d in zip(
              memory["worker_peak_bytes"], memory["worker_peak_above_idle_bytes"],
              strict=True)))
    print(f"  one process ({local['kernel']}): {numpy_s:.2f} s, peak RSS "
          f"{local['process_peak_bytes'] / mib:.0f} MiB "
          f"(+{local['process_peak_above_idle_bytes'] / mib:.0f} over idle)")


if __name__ == "__main__":
    main()
