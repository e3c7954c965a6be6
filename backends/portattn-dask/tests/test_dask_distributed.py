"""Key cases on a two-process ``dask.distributed.LocalCluster`` (loopback only), and the
client's kernel overrides travelling with the graph to the workers."""

from __future__ import annotations

import pytest
from portattn_dask import DaskBlockwiseKernel

import portattn
from portattn.errors import KernelNotUsableError, NoKernelError
from portattn.kernel import describe
from portattn.testing import assert_close, conformance_cases, oracle
from portattn.testing.plugin import require_library

# The dask env installs distributed: there a missing one fails instead of skipping.
distributed = require_library("distributed", backend="dask")

TIMEOUT = "60s"
SECONDS = 60
KEY_CASES = {"basic", "causal_bottom_right_cross", "causal_top_left_long_queries",
             "window_both_sides", "window_and_lengths", "dense", "bias_full",
             "grouped_query_causal", "softcap", "no_keys",
             # kinds read through the block form, a mask function, ALiBi and sinks
             "documents_causal", "global_tokens_and_window", "function_per_batch_and_head",
             "alibi_per_batch_cross", "sinks"}
#: Two chunks per axis or so: every kind of block, few tasks (each costs milliseconds).
CHUNKS = (1, 2, 17, None)
CASES = [c for c in conformance_cases(DaskBlockwiseKernel)
         if c.name in KEY_CASES and c.dtype == "float32"]


@pytest.fixture(scope="module")
def client():
    import dask

    config = {"distributed.comm.timeouts.connect": TIMEOUT,
              "distributed.comm.timeouts.tcp": TIMEOUT}
    with dask.config.set(config), distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
            dashboard_address=None, worker_dashboard_address=None,
            memory_limit="1GiB") as cluster, distributed.Client(
            cluster, timeout=TIMEOUT, set_as_default=False) as client:
        client.wait_for_workers(2, timeout=SECONDS)
        yield client


def test_every_key_case_exists():
    # a renamed conformance case must not drop out of the cluster run unnoticed
    assert {c.name for c in CASES} == KEY_CASES


@pytest.mark.parametrize("case", CASES, ids=str)
def test_key_case_on_cluster(case, client, make_chunked):
    args, kwargs, np_args, np_kwargs = case.build(make_chunked("cluster", CHUNKS))
    out, lse, _ = DaskBlockwiseKernel().run(describe(*args, **kwargs))
    got_out, got_lse = (f.result(timeout=SECONDS) for f in client.compute([out, lse]))
    want_out, want_lse, _ = oracle(*np_args, **np_kwargs)
    assert_close(got_out, want_out, case.dtype, "out")
    assert_close(got_lse, want_lse, case.dtype, "lse")


def test_blocks_run_on_both_workers(client):
    import dask.array as da

    # inputs made on the workers, one batch element per block: nothing pins the work
    rng = da.random.default_rng(0)
    q, k, v = (rng.standard_normal((8, 2, 16, 8), chunks=(1, 2, 16, 8)) for _ in range(3))
    out = client.persist(portattn.attention(q, k, v, kernel="dask_blockwise"))
    for block in distributed.futures_of(out):
        block.result(timeout=SECONDS)
    holders = {w for ws in client.who_has(out).values() for w in ws}
    assert len(holders) == 2
    want = oracle(*(f.result(timeout=SECONDS) for f in client.compute([q, k, v])))[0]
    assert_close(client.compute(out).result(timeout=SECONDS), want, "float64")


def test_mask_arrays_kept_on_the_cluster(client):
    import dask.array as da
    import numpy as np

    from portattn import masks

    # segment ids and inputs live on the workers of a client that is not the default:
    # building the graph reads the ids through it
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 2, 40, 8)) for _ in range(3))
    ids = np.stack([np.repeat([0, 1, 2, 3], 10), np.repeat([0, 1], [31, 9])])
    dq, dk, dv = (client.persist(da.from_array(a, chunks=(1, 2, 10, 8))) for a in (q, k, v))
    lazy = masks.causal() & masks.documents(client.persist(da.from_array(ids, chunks=(1, 20))))
    out = portattn.attention(dq, dk, dv, mask=lazy, kernel="dask_blockwise")
    blocks = [key for key in dict(out.__dask_graph__())
              if str(key[0]).startswith("attention-block-")]
    assert len(blocks) < 2 * (1 + 2 + 3 + 4)  # fewer than causal alone schedules
    want = oracle(q, k, v, mask=masks.causal() & masks.documents(ids))[0]
    assert_close(client.compute(out).result(timeout=SECONDS), want, "float64")


def _inputs(make_chunked):
    case = next(c for c in CASES if c.name == "basic")
    args, _, np_args, _ = case.build(make_chunked("cluster", CHUNKS))
    return args, oracle(*np_args)[0]


@pytest.fixture(params=["threads", "cluster"])
def compute(request):
    """Compute a graph (after the override block closed) on threads or on the cluster."""
    if request.param == "threads":
        import dask

        return lambda out: dask.compute(out, scheduler="threads")[0]
    client = request.getfixturevalue("client")
    return lambda out: client.compute(out).result(timeout=SECONDS)


def test_forced_kernel_reaches_the_chunks(compute, make_chunked):
    (q, k, v), want = _inputs(make_chunked)
    with portattn.use_kernel("reference"):
        out = portattn.attention(q, k, v, kernel="dask_blockwise")
    assert_close(compute(out), want, "float32")
    with portattn.use_kernel("torch_sdpa"):  # forced, so it must not fall back quietly
        out = portattn.attention(q, k, v, kernel="dask_blockwise")
    with pytest.raises(KernelNotUsableError, match=r"torch_sdpa"):
        compute(out)


def test_disabled_kernels_stay_disabled_in_the_chunks(compute, make_chunked):
    (q, k, v), want = _inputs(make_chunked)
    others = [e.name for e in portattn.kernels() if e.name != "dask_blockwise"]
    with portattn.disable_kernels(*others):
        out = portattn.attention(q, k, v)
    with pytest.raises(NoKernelError, match=r"disabled by portattn.disable_kernels\(\)"):
        compute(out)
    assert_close(compute(portattn.attention(q, k, v)), want, "float32")


def test_forcing_this_kernel_leaves_the_chunks_free(compute, make_chunked):
    (q, k, v), want = _inputs(make_chunked)
    with portattn.use_kernel("dask_blockwise"):
        out = portattn.attention(q, k, v)
        # the synchronous scheduler runs the chunks here, inside the block
        inside = out.compute(scheduler="sync")
    assert_close(inside, want, "float32")
    assert_close(compute(out), want, "float32")
