"""Serving: a decode step over a paged KV cache, against the same keys held contiguously.

The batch of a server decoding: S = 16 sequences of 4096 cached tokens each, one new
query per sequence, a small model's attention (Hq = 8 query heads sharing Hkv = 2
key/value heads, D = 64, float32). The keys sit in pages of 16 tokens, every
sequence's pages scattered at random over a pool that holds them all (4096 pages of
``(16, Hkv, D)``, flash-attn's and vLLM's ``blhd`` layout; ``bhld``, ``(Hkv, 16, D)``
pages, too).

- ``portattn.paged_attention(q (16, Hq, D), pools, block_table, key_lengths)`` against
  ``portattn.attention(q (16, Hq, 1, D), K (16, Hkv, 4096, D), V)``, the same keys laid
  out contiguously, no mask, whichever kernel the dispatcher picks (``numpy_fast``,
  ``torch_sdpa``, ``jax_dpa`` here), on NumPy, torch (CPU) and JAX (CPU). Paged calls
  on torch and JAX go to ``numpy_fast``, which borrows their arrays through DLPack;
  the ``*-own-loop`` cases disable it, for the library's own paged loop (torch: the
  portable loop; JAX: ``jax_flash``). Target: paged / contiguous <= 1.1.
- ``paged_attention`` on torch against torch's own paged attention:
  ``torch.nn.attention.experimental._paged_attention.PagedAttention`` (the same pages,
  its cache ``(1, Hkv, pages * 16, D)``) with ``flex_attention`` compiled by
  ``torch.compile``, its block mask converted to the pages. Skipped, with the reason,
  where it does not compile or takes over ``FLEX_COMPILE_LIMIT`` seconds.
  Target: portattn / Flex <= 1.0.
- Memory: how ``PagedKVCache``'s pool grows with the pages in use (sequences of
  several lengths appended, some freed, new ones added), against the contiguous cache
  a batch padded to its longest sequence needs, in ``extra_info`` and printed; and the
  time of one decode step's cache write (one token for each of 16 sequences).

Each ratio is timed in turns (``in_turns``: min(ours) / min(peer) and the median of the
per-round ratios); each case first checks the paged output against the peer's. torch
runs on one thread (its small operations otherwise measure how its OpenMP threads wait
for the machine's other users), and so does ``numpy_fast`` where it runs torch's paged
calls; NumPy and JAX on every core. Run::

    pytest -c pyproject.toml bench/test_paged.py --benchmark-only -p no:cacheprovider

``PORTATTN_BENCH_ROUNDS`` sets the rounds (7). One decode step's overhead over torch's
SDPA on NumPy ((1, 8, 1, 64) against 4096 keys) is measured by
``test_numpy_fast.py::test_short_over_torch_in_turns[decode-8x4096x64]``.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import portattn
from portattn import PagedKVCache

if TYPE_CHECKING:
    from collections.abc import Iterator

# torch.compile imports modules of torch's that use its own deprecated APIs
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SEQUENCES, CACHED, PAGE = 16, 4096, 16
HQ, HKV, D = 8, 2, 64
ROUNDS = int(os.environ.get("PORTATTN_BENCH_ROUNDS", "7"))
TARGET_CONTIGUOUS, TARGET_FLEX = 1.1, 1.0
FLEX_COMPILE_LIMIT = 180  # seconds
SHAPE = (f"S={SEQUENCES} x {CACHED} cached keys, page {PAGE}, Hq={HQ}, Hkv={HKV}, D={D}, "
         "float32")


def _say(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():  # shown even when the run captures output
        print(line)


@pytest.fixture(scope="module")
def decode_step() -> dict[str, np.ndarray]:
    """One decode step's inputs on NumPy: the query, the contiguous keys and values,
    their pages scattered over the pools in both layouts, the block table and the
    lengths."""
    rng = np.random.default_rng(0)
    pages = SEQUENCES * CACHED // PAGE
    table = rng.permutation(pages).reshape(SEQUENCES, CACHED // PAGE).astype(np.int32)
    data = {"query": rng.standard_normal((SEQUENCES, HQ, D), dtype=np.float32),
            "block_table": table,
            "key_lengths": np.full(SEQUENCES, CACHED, dtype=np.int32)}
    for name in ("key", "value"):
        x = rng.standard_normal((SEQUENCES, HKV, CACHED, D), dtype=np.float32)
        data[name] = x
        # page j of sequence s holds its keys j * PAGE ... (j + 1) * PAGE - 1
        by_page = x.reshape(SEQUENCES, HKV, CACHED // PAGE, PAGE, D)
        blhd = np.empty((pages, PAGE, HKV, D), np.float32)
        blhd[table.reshape(-1)] = by_page.transpose(0, 2, 3, 1, 4).reshape(-1, PAGE, HKV, D)
        bhld = np.empty((pages, HKV, PAGE, D), np.float32)
        bhld[table.reshape(-1)] = by_page.transpose(0, 2, 1, 3, 4).reshape(-1, HKV, PAGE, D)
        data[f"{name}_pages_blhd"], data[f"{name}_pages_bhld"] = blhd, bhld
    return data


def _on(library: str, data: dict[str, np.ndarray]) -> tuple[dict[str, Any], Any]:
    """The inputs on ``library``, and what waits for a result there."""
    if library == "torch":
        torch = pytest.importorskip("torch")
        return {name: torch.from_numpy(a) for name, a in data.items()}, lambda x: x
    if library == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return ({name: jnp.asarray(a) for name, a in data.items()},
                lambda x: x.block_until_ready())
    return dict(data), lambda x: x


@contextlib.contextmanager
def _one_torch_thread(library: str) -> Iterator[None]:
    """torch on one thread: its many small operations, timed with other users on the
    cores, otherwise measure how its OpenMP threads wait on each other. So is
    ``numpy_fast``, which runs torch's paged calls: the two sides of a torch ratio use
    the same threads."""
    if library != "torch":
        yield
        return
    import torch

    numpy_plugin = _numpy_plugin()
    threads, numpy_threads = torch.get_num_threads(), None
    torch.set_num_threads(1)
    if numpy_plugin is not None:
        numpy_threads = numpy_plugin.get_num_threads()
        numpy_plugin.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if numpy_plugin is not None:
            numpy_plugin.set_num_threads(numpy_threads)


def _numpy_plugin() -> Any:
    try:
        import portattn_numpy
    except ImportError:
        return None
    return portattn_numpy


def _paged(arrays: dict[str, Any], layout: str, done: Any) -> Any:
    def call() -> Any:
        return done(portattn.paged_attention(
            arrays["query"], arrays[f"key_pages_{layout}"], arrays[f"value_pages_{layout}"],
            block_table=arrays["block_table"], key_lengths=arrays["key_lengths"],
            layout=layout))
    return call


#: Each library, and the kernels disabled for its paged calls: as dispatched, and
#: each library's own paged loop where ``numpy_fast`` would take the call.
CASES = {"numpy": ("numpy", ()), "torch": ("torch", ()), "jax": ("jax", ()),
         "torch-own-loop": ("torch", ("numpy_fast",)),
         "jax-own-loop": ("jax", ("numpy_fast",))}


@pytest.mark.benchmark(group="paged decode / contiguous decode")
@pytest.mark.parametrize("layout", ["blhd", "bhld"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_over_contiguous(case: str, layout: str, decode_step: dict[str, np.ndarray],
                               in_turns: Any, benchmark: Any,
                               capsys: pytest.CaptureFixture[str]) -> None:
    """One decode step from the pages against the same from the contiguous cache."""
    library, disabled = CASES[case]
    arrays, done = _on(library, decode_step)
    query = arrays["query"][:, :, None, :]  # (S, Hq, 1, D)
    key, value = arrays["key"], arrays["value"]
    kernel = portattn.explain(query, key, value).kernel.name
    with portattn.disable_kernels(*disabled):
        plan = portattn.explain_paged(
            arrays["query"], arrays[f"key_pages_{layout}"], arrays[f"value_pages_{layout}"],
            block_table=arrays["block_table"], key_lengths=arrays["key_lengths"],
            layout=layout)
    paged_kernel = "portable loop" if plan.kernel is None else plan.kernel.name
    paged = _disabled(disabled, _paged(arrays, layout, done))

    def contiguous() -> Any:
        return done(portattn.attention(query, key, value))

    np.testing.assert_allclose(np.asarray(paged()), np.asarray(contiguous())[:, :, 0],
                               rtol=1e-4, atol=1e-5)
    with _one_torch_thread(library):
        best, median = in_turns(paged, contiguous, ROUNDS)
    benchmark.extra_info.update(shape=SHAPE, library=library, layout=layout,
                                torch_threads=1 if library == "torch" else None,
                                paged_kernel=paged_kernel, contiguous_kernel=kernel,
                                by_minimum=best, median_per_round=median,
                                target=TARGET_CONTIGUOUS)
    _say(capsys, f"\npaged ({layout}, {paged_kernel}) / contiguous ({kernel}) decode on "
                 f"{library}, in turns: {best:.2f} by minimum, {median:.2f} median per "
                 f"round (target <= {TARGET_CONTIGUOUS})")


def _disabled(names: tuple[str, ...], call: Any) -> Any:
    """``call`` with the kernels ``names`` disabled while it runs."""
    def run() -> Any:
        with portattn.disable_kernels(*names):
            return call()
    return run


class _CompileTimeout(Exception):
    pass


def _within(seconds: int, call: Any) -> Any:
    """``call()``, interrupted after ``seconds`` (main thread, POSIX)."""
    def expired(signum: int, frame: Any) -> None:
        raise _CompileTimeout

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        return call()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.benchmark(group="paged decode / compiled FlexAttention PagedAttention")
def test_paged_over_flex(decode_step: dict[str, np.ndarray], in_turns: Any, benchmark: Any,
                         capsys: pytest.CaptureFixture[str]) -> None:
    """portattn's paged decode on torch against torch's PagedAttention + compiled
    flex_attention, over the same pages."""
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    paged_module = pytest.importorskip("torch.nn.attention.experimental._paged_attention")
    arrays, done = _on("torch", decode_step)
    table, pages = decode_step["block_table"], SEQUENCES * CACHED // PAGE
    cache = paged_module.PagedAttention(pages, PAGE, SEQUENCES, device="cpu")
    for s in range(SEQUENCES):  # the same pages: reserve takes the free list's last ones
        cache.empty_pages = [int(p) for p in table[s]]
        cache.reserve(torch.tensor([s]), torch.tensor([CACHED]))
    assert torch.equal(cache.page_table[:, :CACHED // PAGE], arrays["block_table"].long())

    def flat(pool: np.ndarray) -> Any:  # (1, Hkv, pages * PAGE, D), flex's cache
        return torch.from_numpy(np.ascontiguousarray(
            pool.reshape(pages * PAGE, HKV, D).transpose(1, 0, 2))[None])

    k_cache, v_cache = flat(decode_step["key_pages_blhd"]), flat(decode_step["value_pages_blhd"])
    logical = flex.create_block_mask(lambda b, h, q, k: k >= 0, SEQUENCES, None, 1, CACHED,
                                     device="cpu", BLOCK_SIZE=(128, PAGE))
    block_mask = cache.convert_logical_block_mask(
        logical, kv_len=arrays["key_lengths"].long())
    query = arrays["query"][:, :, None, :]
    compiled = torch.compile(flex.flex_attention, dynamic=False)

    def theirs() -> Any:
        return compiled(query, k_cache, v_cache, block_mask=block_mask, enable_gqa=True)

    ours = _paged(arrays, "blhd", done)
    # compiled on the thread it runs on: inductor's C++ kernels fix their thread count
    with torch.no_grad(), _one_torch_thread("torch"):
        start = time.perf_counter()
        try:
            expected = _within(FLEX_COMPILE_LIMIT, theirs)
        except _CompileTimeout:
            pytest.skip(f"compiling flex_attention for PagedAttention on CPU took over "
                        f"{FLEX_COMPILE_LIMIT} s")
        except Exception as e:  # what inductor raises varies by version
            first = (str(e).strip().splitlines() or [""])[0][:200]
            pytest.skip(f"flex_attention for PagedAttention does not compile on this "
                        f"CPU: {type(e).__name__}: {first}")
        seconds = time.perf_counter() - start
        torch.testing.assert_close(ours(), expected[:, :, 0], rtol=1e-4, atol=1e-5)
        best, median = in_turns(ours, theirs, ROUNDS)
    benchmark.extra_info.update(shape=SHAPE, by_minimum=best, median_per_round=median,
                                target=TARGET_FLEX, flex_compile_seconds=seconds,
                                torch_threads=1)
    _say(capsys, f"\npaged_attention (torch) / compiled Flex PagedAttention, in turns: "
                 f"{best:.2f} by minimum, {median:.2f} median per round (target <= "
                 f"{TARGET_FLEX}; flex compiled in {seconds:.0f} s)")


#: Prompt lengths of the sequences the memory report fills the cache with.
PROMPTS = (1, 15, 16, 17, 100, 250, 513, 1000, 2048, 4096)


@pytest.mark.benchmark(group="PagedKVCache pool")
def test_pool_grows_with_pages_in_use(benchmark: Any,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The pool as sequences come and go; timed: one decode step's write (a token for
    each of 16 sequences) into the filled cache."""
    rng = np.random.default_rng(1)
    cache = PagedKVCache.empty(PAGE, HKV, D, num_pages=16)
    page_bytes = 2 * PAGE * HKV * D * 4  # keys and values
    rows: list[dict[str, Any]] = []

    def record(event: str) -> None:
        lengths = [cache.length(s) for s in cache.sequences]
        longest = max(lengths, default=0)
        rows.append({
            "event": event, "sequences": len(lengths), "tokens": sum(lengths),
            "pages_needed": sum(math.ceil(n / PAGE) for n in lengths),
            "pages_in_use": cache.pages_in_use, "num_pages": cache.num_pages,
            "pool_mib": cache.num_pages * page_bytes / 2**20,
            "padded_contiguous_mib": len(lengths) * longest * page_bytes / PAGE / 2**20})

    def prefill(length: int) -> int:
        seq = cache.add()
        new = rng.standard_normal((length, HKV, D), dtype=np.float32)
        cache.append([seq], new, new, counts=[length])
        return seq

    record("empty")
    live = []
    for length in PROMPTS:
        live.append(prefill(length))
        record(f"+ prompt of {length}")
    for seq in live[-3:]:  # the longest end
        cache.free(seq)
    record("3 longest freed")
    for length in (2048, 1000):
        live.append(prefill(length))
        record(f"+ prompt of {length} (reuses freed pages)")
    for row in rows:
        assert row["pages_in_use"] == row["pages_needed"]  # no page held twice, none lost
    decoding = cache.sequences[:SEQUENCES]
    while len(decoding) < SEQUENCES:
        decoding.append(prefill(int(rng.integers(1, 512))))
    record(f"{SEQUENCES} sequences")
    token = rng.standard_normal((SEQUENCES, HKV, D), dtype=np.float32)
    benchmark.pedantic(lambda: cache.append(decoding, token, token), rounds=20,
                       warmup_rounds=1, iterations=1)
    record(f"after 21 decode steps of {SEQUENCES} sequences")
    benchmark.extra_info.update(page=PAGE, heads=HKV, head_dim=D, dtype="float32",
                                page_bytes=page_bytes, growth=rows)
    lines = [f"{r['event']:>44}: {r['sequences']:2d} seqs {r['tokens']:6d} tokens, "
             f"{r['pages_in_use']:4d} pages in use of {r['num_pages']:4d} "
             f"({r['pool_mib']:6.2f} MiB pool; padded contiguous "
             f"{r['padded_contiguous_mib']:6.2f} MiB)" for r in rows]
    _say(capsys, "\nPagedKVCache pool (page 16, Hkv=2, D=64, float32, keys + values):\n"
         + "\n".join(lines))
