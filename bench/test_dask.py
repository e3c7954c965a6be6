"""Dask: attention over a large batch on a cluster, and the blocks a mask hides.

**A large batch**: a 2-worker Dask LocalCluster against one NumPy process.

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

**Packed documents**: ``causal() & documents(ids)`` (8 documents of random lengths in
one row) against ``causal()`` alone, ``(1, 8, 8192, 64)`` float32 in chunks of 1024
along both sequence axes, on the threaded scheduler, timed in turns (building the
graph, which reads the ids, and computing it). Recorded: the attention blocks each
graph schedules, and the time ratio (best, and median of the rounds).

    python -m pytest -c pyproject.toml bench/test_dask.py -k packed --benchmark-only -s
    python bench/test_dask.py packed     # the same, as a table of best and median times

``PORTATTN_DASK_BENCH_ROUNDS`` sets the rounds (default 5).
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
PACKED_SHAPE = (1, 8, 8192, 64)
PACKED_CHUNK = 1024
DOCUMENTS = 8
ROUNDS = int(os.environ.get("PORTATTN_DASK_BENCH_ROUNDS", "5"))


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


# --- packed documents --------------------------------------------------------------
def packed_call() -> tuple[tuple[Any, Any, Any], dict[str, Any]]:
    """q, k, v as Dask arrays and the two masks, ``{"documents": ..., "causal": ...}``."""
    import dask.array as da
    import numpy as np

    from portattn import masks

    rng = np.random.default_rng(0)
    length = PACKED_SHAPE[-2]
    cuts = np.sort(rng.choice(np.arange(1, length), DOCUMENTS - 1, replace=False))
    ids = np.repeat(np.arange(DOCUMENTS), np.diff(np.concatenate([[0], cuts, [length]])))
    chunks = (1, 8, PACKED_CHUNK, 64)
    arrays = tuple(da.from_array(rng.standard_normal(PACKED_SHAPE, dtype=np.float32),
                                 chunks=chunks) for _ in range(3))
    lazy_ids = da.from_array(ids[None], chunks=(1, PACKED_CHUNK))
    return arrays, {"documents": masks.causal() & masks.documents(lazy_ids),
                    "causal": masks.causal()}


def scheduled_blocks(arrays: tuple[Any, Any, Any], mask: Any) -> int:
    import portattn

    out = portattn.attention(*arrays, mask=mask)
    return sum(str(key[0]).startswith("attention-block-") for key in dict(out.__dask_graph__()))


def run_packed(arrays: tuple[Any, Any, Any], mask: Any) -> Any:
    """Build the graph and compute it on threads."""
    import portattn

    return portattn.attention(*arrays, mask=mask).compute(scheduler="threads")


def packed_turns(rounds: int) -> dict[str, list[float]]:
    """Seconds per run of each mask, the two run in turns (causal first each round),
    after one untimed run of each."""
    arrays, packed = packed_call()
    times: dict[str, list[float]] = {name: [] for name in ("causal", "documents")}
    for round_ in range(rounds + 1):
        for name in times:
            start = time.perf_counter()
            run_packed(arrays, packed[name])
            if round_:
                times[name].append(time.perf_counter() - start)
    return times


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


@pytest.mark.benchmark(group=f"dask packed documents {PACKED_SHAPE} float32")
def test_packed_documents_in_turns(in_turns: Any, benchmark: Any) -> None:
    import portattn

    arrays, packed = packed_call()
    blocks = {name: scheduled_blocks(arrays, mask) for name, mask in packed.items()}
    best, median = in_turns(lambda: run_packed(arrays, packed["documents"]),
                            lambda: run_packed(arrays, packed["causal"]), rounds=ROUNDS)
    benchmark.extra_info.update(
        chunk=PACKED_CHUNK, documents=DOCUMENTS, blocks_documents=blocks["documents"],
        blocks_causal=blocks["causal"], time_ratio_best=best, time_ratio_median=median,
        chunk_kernel=portattn.explain(*(a[..., :PACKED_CHUNK, :].compute() for a in arrays),
                                      mask=portattn.masks.causal()).kernel.name)
    print(f"\npacked documents {PACKED_SHAPE}, chunks of {PACKED_CHUNK}: blocks "
          f"{blocks['documents']} (documents) vs {blocks['causal']} (causal); time "
          f"documents / causal {best:.3g} (best), {median:.3g} (median of rounds)")


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


def main_packed() -> None:
    import statistics

    arrays, packed = packed_call()
    blocks = {name: scheduled_blocks(arrays, mask) for name, mask in packed.items()}
    times = packed_turns(ROUNDS)
    print(f"packed documents {PACKED_SHAPE} float32, chunks of {PACKED_CHUNK}, threads, "
          f"{ROUNDS} rounds in turns")
    for name, runs in times.items():
        print(f"  {name:<9}: {blocks[name]:>3} blocks, best {min(runs):.2f} s, median "
              f"{statistics.median(runs):.2f} s")
    ratios = [d / c for d, c in zip(times["documents"], times["causal"], strict=True)]
    print(f"  documents / causal: best {min(times['documents']) / min(times['causal']):.3f},"
          f" median of rounds {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    if sys.argv[1:] == ["packed"]:
        main_packed()
    else:
        main()
