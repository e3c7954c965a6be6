"""numpy_fast against torch's fused CPU attention and the textbook NumPy code.

Shapes (1, 8, N, 64) float32 for N = 512, 2048, 8192, with and without a causal mask,
plus the peak memory (tracemalloc) of numpy_fast at (1, 1, 16384, 64), and small
heads (many short heads, a decode step) against the portable ``tiled`` kernel. Every
benchmark records GFLOP/s; numpy_fast's also record, in ``extra_info`` and in lines
written to the terminal, its time over torch's, over the textbook code's, and causal
over non-causal, each from separate benchmarks. ``test_ratio_in_turns`` measures the
ratios to report (over torch, causal over full) again with the two calls timed in
alternation, which cancels most of a shared machine's drift. The reference line is
NumPy's own sgemm (a 2048 x 2048 float32 product, every core): each numpy_fast line
gives its share of that rate, and ``test_share_of_sgemm_in_turns`` measures the share
with the two timed in alternation. Run::

    pytest bench/test_numpy_fast.py -p no:cacheprovider

Both libraries use every core by default (``PORTATTN_NUMPY_THREADS`` and
``torch.set_num_threads`` change that). Needs ``portattn-numpy`` installed; the torch
baseline is skipped without torch.
"""

from __future__ import annotations

import math
import tracemalloc
from typing import Any

import numpy as np
import pytest

import portattn
from portattn import masks

pytest.importorskip("portattn_numpy")

SIZES = (512, 2048, 8192)
HEADS, HEAD_DIM = 8, 64
ROUNDS = {512: 20, 2048: 5, 8192: 3}
IMPLS = ("torch_sdpa", "textbook", "numpy_fast")  # numpy_fast last: its ratios need both
_best: dict[tuple[str, int, bool], float] = {}
SGEMM_N = 2048
SGEMM_FLOPS = 2 * SGEMM_N**3


def _sgemm() -> Any:
    """NumPy's float32 matrix product at 2048 x 2048 (BLAS on every core)."""
    a, b = (np.random.default_rng(seed).standard_normal((SGEMM_N, SGEMM_N), dtype=np.float32)
            for seed in (1, 2))
    out = np.empty_like(a)
    return lambda: np.matmul(a, b, out=out)


def _kernels() -> str:
    """The kernels of the BLAS libraries loaded, as threadpoolctl names them: OpenBLAS
    picks them as it loads (``OPENBLAS_CORETYPE`` forces them), and they set the
    reference rate (on a Zen 5 core, sgemm ran 1.8-1.9x as fast with OpenBLAS's AVX-512
    "SkylakeX" kernels as with its AVX2 "Haswell" ones)."""
    from threadpoolctl import threadpool_info

    found = [f"{info['internal_api']} {info.get('architecture') or ''}".strip()
             for info in threadpool_info() if info["user_api"] == "blas"]
    return ", ".join(found) or "BLAS unknown"


@pytest.fixture(scope="module")
def sgemm_gflops() -> float:
    """NumPy's sgemm rate on this machine (best of 10), the reference line."""
    import time

    call, best = _sgemm(), math.inf
    call()
    for _ in range(10):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return SGEMM_FLOPS / best / 1e9


def _inputs(n: int, heads: int = HEADS) -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(n)
    shape = (1, heads, n, HEAD_DIM)
    return tuple(rng.standard_normal(shape, dtype=np.float32) for _ in range(3))


def _textbook(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """softmax(q k^T / sqrt(d)) v, one head at a time (all 8 at N=8192 would need 8 GB)."""
    out = np.empty(q.shape[:-1] + v.shape[-1:], q.dtype)
    n = q.shape[-2]
    hide = np.triu(np.ones((n, n), bool), 1) if causal else None
    for h in range(q.shape[1]):
        s = q[0, h] @ k[0, h].T / math.sqrt(q.shape[-1])
        if hide is not None:
            s[hide] = -np.inf
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[0, h] = (p / p.sum(axis=-1, keepdims=True)) @ v[0, h]
    return out


def _call(impl: str, q: Any, k: Any, v: Any, causal: bool) -> Any:
    if impl == "numpy_fast":
        mask = masks.causal() if causal else None
        return lambda: portattn.attention(q, k, v, mask=mask, kernel="numpy_fast")
    if impl == "textbook":
        return lambda: _textbook(q, k, v, causal)
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(tq, tk, tv, is_causal=causal)


def _say(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():  # shown even when the run captures output
        print(line)


@pytest.mark.parametrize(("n", "causal", "impl"), [
    pytest.param(n, causal, impl, id=f"{n}-{'causal' if causal else 'full'}-{impl}")
    for n in SIZES for causal in (False, True) for impl in IMPLS])
def test_attention(n: int, causal: bool, impl: str, benchmark: Any, sgemm_gflops: float,
                   capsys: pytest.CaptureFixture[str]) -> None:
    q, k, v = _inputs(n)
    call = _call(impl, q, k, v, causal)
    flops = 4 * HEADS * n * n * HEAD_DIM / (2 if causal else 1)
    benchmark.group = f"(1, {HEADS}, {n}, {HEAD_DIM}) float32 {'causal' if causal else 'full'}"
    benchmark.extra_info.update(impl=impl, n=n, causal=causal, flops=flops)
    out = benchmark.pedantic(call, rounds=ROUNDS[n], warmup_rounds=1, iterations=1)
    assert tuple(out.shape) == (1, HEADS, n, HEAD_DIM)
    stats = getattr(benchmark.stats, "stats", None)  # None with --benchmark-disable
    if stats is None:
        return
    best = _best[impl, n, causal] = stats.min
    benchmark.extra_info.update(gflops=flops / best / 1e9, sgemm_gflops=sgemm_gflops,
                                share_of_sgemm=flops / best / 1e9 / sgemm_gflops,
                                blas=_kernels())
    if impl != "numpy_fast":
        return
    ratios = {f"over_{other}": best / _best[other, n, causal]
              for other in IMPLS[:-1] if (other, n, causal) in _best}
    if causal and (impl, n, False) in _best:
        ratios["causal_over_full"] = best / _best[impl, n, False]
    benchmark.extra_info.update(ratios)
    listed = "  ".join(f"{name}={value:.2f}" for name, value in ratios.items())
    _say(capsys, f"\nnumpy_fast N={n} {'causal' if causal else 'full'}: "
                  f"{best * 1e3:.1f} ms, {flops / best / 1e9:.0f} GFLOP/s = "
                  f"{flops / best / 1e9 / sgemm_gflops:.0%} of NumPy's sgemm "
                  f"({sgemm_gflops:.0f} GFLOP/s, {_kernels()})  {listed}")


TURNS = {512: 30, 2048: 10, 8192: 3}
PEERS = {
    "over_torch_sdpa": lambda q, k, v, causal: _call("torch_sdpa", q, k, v, causal),
    "causal_over_full": lambda q, k, v, causal: _call("numpy_fast", q, k, v, False),
}


@pytest.mark.parametrize(("n", "causal", "ratio"), [
    pytest.param(n, causal, ratio, id=f"{n}-{'causal' if causal else 'full'}-{ratio}")
    for n in SIZES for causal in (False, True) for ratio in PEERS
    if causal or ratio != "causal_over_full"])
def test_ratio_in_turns(n: int, causal: bool, ratio: str, in_turns: Any, benchmark: Any,
                        capsys: pytest.CaptureFixture[str]) -> None:
    """numpy_fast over a peer, the two timed in alternation (the figures to report)."""
    q, k, v = _inputs(n)
    ours = _call("numpy_fast", q, k, v, causal)
    benchmark.group = f"in turns: numpy_fast {ratio}"
    best, median = in_turns(ours, PEERS[ratio](q, k, v, causal), TURNS[n])
    benchmark.extra_info.update(n=n, causal=causal, ratio=ratio, by_minimum=best,
                                median_per_round=median)
    _say(capsys, f"\nnumpy_fast N={n} {'causal' if causal else 'full'} {ratio}, in turns: "
                 f"{best:.3f} by minimum, {median:.3f} median per round")


@pytest.mark.parametrize(("n", "causal"), [
    pytest.param(n, causal, id=f"{n}-{'causal' if causal else 'full'}")
    for n in (2048, 8192) for causal in (False, True)])
def test_share_of_sgemm_in_turns(n: int, causal: bool, in_turns: Any, benchmark: Any,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """numpy_fast's GFLOP/s over NumPy's sgemm rate, the two timed in alternation."""
    q, k, v = _inputs(n)
    flops = 4 * HEADS * n * n * HEAD_DIM / (2 if causal else 1)
    benchmark.group = "in turns: numpy_fast share of NumPy's sgemm rate"
    best, median = in_turns(_call("numpy_fast", q, k, v, causal), _sgemm(), TURNS[n])
    work = flops / SGEMM_FLOPS  # time ratio -> rate ratio
    benchmark.extra_info.update(n=n, causal=causal, share_by_minimum=work / best,
                                share_median_per_round=work / median, blas=_kernels())
    _say(capsys, f"\nnumpy_fast N={n} {'causal' if causal else 'full'} share of NumPy's "
                 f"sgemm rate ({_kernels()}), in turns: {work / best:.0%} by minimum, "
                 f"{work / median:.0%} median per round")


def _bare_tiles(n: int) -> Any:
    """The calls numpy_fast's tiles make, and nothing else: per tile of one head (the
    kernel's own tile shape on one thread) the score product into rows padded to a
    cache line past a multiple of 2 KiB, the weights and their row sums from the
    kernel's own ``ScoreTile.weights`` with the exponential that runs fastest here
    (``Config.exponential_for``), and the weights-times-values product, accumulated;
    where the kernel runs them compiled (``_compiled_blocks``), that one call per tile
    of queries instead. No masking, checks, threads or division."""
    from types import SimpleNamespace

    from portattn_numpy import Config, _jit
    from portattn_numpy._exponential import BASE_2, in_place, in_rows
    from portattn_numpy._plan import block_sizes
    from portattn_numpy._scores import ScoreTile  # the kernel's own tile memory

    config = Config()
    block_q, block_k = block_sizes(n, n, config.score_tile_bytes() // 4, config, heads=HEADS)
    exponential = config.exponential_for(np.float32, bias=False)
    # the two fields of a call's Problem that ScoreTile.weights reads
    problem = SimpleNamespace(exponential=in_place(exponential),
                              exponential_rows=in_rows(exponential))
    scale = (math.log2(math.e) if exponential in BASE_2 else 1) / math.sqrt(HEAD_DIM)
    q, k, v = (x[0] for x in _inputs(n))
    q = np.ascontiguousarray(q * scale)
    scores = ScoreTile("bench.scores", block_k, block_q, np.float32)
    _, tile = scores.scores(block_k, block_q)
    acc, part = np.empty((2, block_q, HEAD_DIM), np.float32)
    sums, part_sums = np.empty((2, block_q), np.float32)
    module = _jit.load("_compiled_blocks") if exponential == "exp2_compiled" else None
    compiled = None if module is None else module.compiled_blocks(np.float32)
    if compiled is not None:
        span, stride = scores.span(block_q, block_k)  # queries by keys, as the kernel's
        spans = np.array([(k0, min(n, k0 + block_k), 0, block_q)
                          for k0 in range(0, n, block_k)], np.int64)

        def run_compiled() -> None:
            for h in range(HEADS):
                for q0 in range(0, n, block_q):
                    compiled.accumulate(1.0, q[h, q0:q0 + block_q], k[h], v[h], acc, sums,
                                        span, stride, spans, first_writes=True)
        return run_compiled

    def run() -> None:
        for h in range(HEADS):
            for q0 in range(0, n, block_q):
                for k0 in range(0, n, block_k):
                    np.matmul(k[h, k0:k0 + block_k], q[h, q0:q0 + block_q].T, out=tile)
                    weights = scores.weights(problem, block_k, block_q, [], part_sums)
                    np.matmul(weights.T, v[h, k0:k0 + block_k], out=part)
                    if k0 == 0:
                        acc[...], sums[...] = part, part_sums
                    else:
                        np.add(acc, part, out=acc)
                        np.add(sums, part_sums, out=sums)

    return run


def test_ceiling_in_turns(in_turns: Any, benchmark: Any,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """What the tile schedule's own calls reach on one core, as a share of one core's
    sgemm (the two timed in alternation), at (1, 8, 2048, 64): the most numpy_fast can
    reach with these NumPy and BLAS calls. Its score product has an inner dimension of
    the head dim (64) and the exponential reads every score once more."""
    import threadpoolctl

    n = 2048
    with threadpoolctl.threadpool_limits(1):
        best, median = in_turns(_bare_tiles(n), _sgemm(), TURNS[n])
    work = 4 * HEADS * n * n * HEAD_DIM / SGEMM_FLOPS
    benchmark.group = "in turns: the tile schedule's bare calls, share of one core's sgemm"
    benchmark.extra_info.update(n=n, share_by_minimum=work / best,
                                share_median_per_round=work / median, blas=_kernels())
    _say(capsys, f"\nbare tile calls N={n}, one core, share of one core's sgemm rate "
                 f"({_kernels()}), in turns: {work / best:.0%} by minimum, "
                 f"{work / median:.0%} median per round")


SMALL = {  # query shapes; a decode step (one query row) meets 4096 keys
    "64x16x16": ((1, 64, 16, 16), None),
    "8x16x32x32-causal": ((8, 16, 32, 32), masks.causal()),
    "decode-4096": ((1, 32, 1, 128), None),
}


SMALL_REPEATS = 20


@pytest.mark.parametrize("case", list(SMALL), ids=list(SMALL))
def test_small_heads_in_turns(case: str, in_turns: Any, benchmark: Any,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """numpy_fast over the portable ``tiled`` kernel where the per-call Python counts."""
    shape, mask = SMALL[case]
    rng = np.random.default_rng(0)
    q = rng.standard_normal(shape, dtype=np.float32)
    kv_shape = (*shape[:2], 4096 if shape[2] == 1 else shape[2], shape[3])
    k, v = (rng.standard_normal(kv_shape, dtype=np.float32) for _ in range(2))

    def run(kernel: str) -> Any:
        def repeated() -> None:  # warm calls: one alone after a pause is mostly wake-up
            for _ in range(SMALL_REPEATS):
                portattn.attention(q, k, v, mask=mask, kernel=kernel)
        return repeated

    benchmark.group = "in turns: numpy_fast over tiled, small heads"
    best, median = in_turns(run("numpy_fast"), run("tiled"), 20)
    benchmark.extra_info.update(case=case, by_minimum=best, median_per_round=median)
    _say(capsys, f"\nnumpy_fast over tiled, {case}, in turns: {best:.3f} by minimum, "
                 f"{median:.3f} median per round")


SHORT = {  # (query shape, key length, causal): short sequences, short key ranges and
    # decode steps
    "8x256x64": ((1, 8, 256, 64), 256, False),
    "8x256x64-causal": ((1, 8, 256, 64), 256, True),
    "4x8x256x64": ((4, 8, 256, 64), 256, False),
    "16x256x128": ((1, 16, 256, 128), 256, False),
    "cross-8x4096-over-128": ((1, 8, 4096, 64), 128, False),  # tall tiles over few keys
    "decode-8x4096x64": ((1, 8, 1, 64), 4096, True),
    "decode-8x4096x64-planned": ((1, 8, 1, 64), 4096, True),
    "decode-32x4096x128": ((1, 32, 1, 128), 4096, True),
    "decode-4x8x1024x64": ((4, 8, 1, 64), 1024, True),
    "decode-8x256x64": ((1, 8, 1, 64), 256, True),
}
#: Settings a case runs with: the planned tiles' time on a decode step, for what the
#: compiled decode loop gains
SHORT_SETTINGS = {"decode-8x4096x64-planned": {"compiled_decode": False}}


@pytest.mark.parametrize("case", list(SHORT), ids=list(SHORT))
def test_short_over_torch_in_turns(case: str, in_turns: Any, benchmark: Any,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """numpy_fast over torch's SDPA on short sequences, short key ranges and decode steps
    (warm calls)."""
    torch = pytest.importorskip("torch")
    from portattn_numpy import configured

    shape, keys, causal = SHORT[case]
    rng = np.random.default_rng(0)
    q = rng.standard_normal(shape, dtype=np.float32)
    k, v = (rng.standard_normal((*shape[:2], keys, shape[3]), dtype=np.float32)
            for _ in range(2))
    mask = masks.causal() if causal else None
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # torch's is_causal is top-left; bottom-right causal is that with as many queries as
    # keys, and no mask at all for one query row over the cache
    is_causal = causal and shape[2] == keys

    settings = SHORT_SETTINGS.get(case, {})

    def ours() -> None:
        with configured(**settings):
            for _ in range(SMALL_REPEATS):
                portattn.attention(q, k, v, mask=mask, kernel="numpy_fast")

    def peer() -> None:
        for _ in range(SMALL_REPEATS):
            sdpa(tq, tk, tv, is_causal=is_causal)

    benchmark.group = "in turns: numpy_fast over torch SDPA, short sequences"
    best, median = in_turns(ours, peer, 20)
    benchmark.extra_info.update(case=case, by_minimum=best, median_per_round=median)
    _say(capsys, f"\nnumpy_fast over torch SDPA, {case}, in turns: {best:.3f} by minimum, "
                 f"{median:.3f} median per round")


STRATEGY_CASES = {  # (query shape, key length, mask): the strategy numpy_fast picks there
    "stacked-64x16x16": ((1, 64, 16, 16), 16, None),
    "stacked-8x16x32x32-causal": ((8, 16, 32, 32), 32, masks.causal()),
    "stacked-decode-4096": ((1, 32, 1, 128), 4096, None),
    "diagonal-2048-causal": ((1, 8, 2048, 64), 2048, masks.causal()),
    "diagonal-8192-causal": ((1, 8, 8192, 64), 8192, masks.causal()),
}


@pytest.mark.parametrize("case", list(STRATEGY_CASES), ids=list(STRATEGY_CASES))
def test_strategy_over_tiles_in_turns(case: str, in_turns: Any, benchmark: Any,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """What a strategy earns: numpy_fast as it is over numpy_fast with tiles only."""
    from portattn_numpy import configured

    shape, keys, mask = STRATEGY_CASES[case]
    rng = np.random.default_rng(0)
    q = rng.standard_normal(shape, dtype=np.float32)
    k, v = (rng.standard_normal((*shape[:2], keys, shape[3]), dtype=np.float32)
            for _ in range(2))
    repeats = 1 if shape[2] * keys >= 1 << 20 else SMALL_REPEATS

    def run(**settings: Any) -> Any:
        def repeated() -> None:
            with configured(**settings):
                for _ in range(repeats):
                    portattn.attention(q, k, v, mask=mask, kernel="numpy_fast")
        return repeated

    used: list[str] = []
    with configured(on_unit=lambda name, _trusted: used.append(name)):
        portattn.attention(q, k, v, mask=mask, kernel="numpy_fast")
    assert used
    assert set(used) == {case.split("-")[0]}
    benchmark.group = "in turns: numpy_fast over numpy_fast with tiles only"
    best, median = in_turns(run(), run(strategies=("tiles",)), 3 if keys >= 8192 else 10)
    benchmark.extra_info.update(case=case, by_minimum=best, median_per_round=median)
    _say(capsys, f"\nnumpy_fast over tiles only, {case}, in turns: {best:.3f} by minimum, "
                 f"{median:.3f} median per round")


def test_peak_memory(benchmark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Peak memory allocated by one call at (1, 1, 16384, 64), inputs excluded."""
    q, k, v = _inputs(16384, heads=1)
    portattn.attention(q, k, v, kernel="numpy_fast")  # pools and caches warm

    def measured() -> int:
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            portattn.attention(q, k, v, kernel="numpy_fast")
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    peak = benchmark.pedantic(measured, rounds=1, iterations=1)
    benchmark.group = "peak memory (1, 1, 16384, 64) float32"
    benchmark.extra_info.update(peak_memory_bytes=peak, peak_memory_mib=peak / 2**20)
    _say(capsys, f"\nnumpy_fast peak memory at (1, 1, 16384, 64): {peak / 2**20:.1f} MiB "
                 "(the output alone is 4.0 MiB)")
