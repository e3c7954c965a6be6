"""Paged calls on JAX run ``jax_flash``'s compiled loop: dispatch gives them to it (on
the CPU unless ``numpy_fast`` is installed, which it defers to there), it
answers as the same call on NumPy does for every option (the NumPy paged path is
checked against the float64 oracle in the core suite), a value it may not read never
reaches a result, and a decode loop compiles a few times, not once a step."""

from __future__ import annotations

import numpy as np
import pytest
from jaxcases import jax_backend

import portattn
from portattn import masks
from portattn.testing.paged import scattered_pages
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")

HQ, HKV, D, DV = 4, 2, 16, 8


def _call(rng, sequences, page, layout="blhd", garbage=0.0, dtype=np.float32):
    """A paged call's arguments: sequences of ``(queries, keys)`` scattered over a pool
    whose other slots hold ``garbage``."""
    k_pool, v_pool, table, _ = scattered_pages(rng, [n for _, n in sequences], page, HKV, D,
                                               DV, layout=layout, garbage=garbage)
    starts = np.cumsum([0] + [q for q, _ in sequences])
    query = rng.standard_normal((starts[-1], HQ, D))
    arrays = tuple(jnp.asarray(np.ascontiguousarray(a).astype(dtype))
                   for a in (query, k_pool, v_pool))
    return arrays, {"block_table": jnp.asarray(table),
                    "key_lengths": jnp.asarray([n for _, n in sequences]),
                    "query_starts": jnp.asarray(starts), "layout": layout}


#: Decodes, short prefills and one prompt of several tiles, and a sequence with no
#: query this step.
MIXED = [(1, 300), (2, 45), (0, 17), (1, 1), (7, 7), (130, 200), (1, 64), (3, 90)]


def _on_numpy(arrays, options):
    """The same call on NumPy, in float32 (NumPy has no bfloat16)."""
    def host(a):
        if not hasattr(a, "dtype"):
            return a
        a = np.asarray(a)
        return a.astype(np.float32) if a.dtype.kind == "V" or a.itemsize == 2 else a

    return portattn.paged_attention(*(host(a) for a in arrays),
                                    **{k: host(v) for k, v in options.items()})


@pytest.fixture(autouse=True)
def _jax_selected():
    jax_backend()  # skips unless JAX is a selected backend; float64 stays float64
    # on the CPU jax_flash defers to numpy_fast where that is installed: its own loop
    # is what these tests check
    with portattn.disable_kernels("numpy_fast"):
        yield


def test_dispatch_gives_paged_jax_calls_to_jax_flash():
    arrays, options = _call(np.random.default_rng(0), MIXED, 16)
    assert portattn.explain_paged(*arrays, **options).kernel.name == "jax_flash"


WINDOW = masks.causal() & masks.sliding_window(20)
WINDOW_SINKS = masks.causal() & (masks.sliding_window(9) | masks.sink_tokens(4))


@pytest.mark.parametrize(("page", "layout", "mask"), [
    (16, "blhd", None), (16, "blhd", masks.causal()), (16, "bhld", WINDOW),
    (16, "blhd", WINDOW_SINKS), (1, "bhld", masks.causal()), (1, "blhd", WINDOW),
    (64, "bhld", WINDOW_SINKS), (64, "blhd", masks.causal())])
def test_agrees_with_numpy(page, layout, mask):
    arrays, options = _call(np.random.default_rng(1), MIXED, page, layout)
    options.update(mask=mask, return_lse=True)
    out, lse = portattn.paged_attention(*arrays, **options)
    want, want_lse = _on_numpy(arrays, options)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("layout", ["blhd", "bhld"])
def test_unused_slots_holding_nan_never_reach_a_result(layout):
    arrays, options = _call(np.random.default_rng(8), MIXED, 16, layout, garbage=np.nan)
    options.update(mask=WINDOW_SINKS)
    out = np.asarray(portattn.paged_attention(*arrays, **options))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(_on_numpy(arrays, options)), rtol=2e-5,
                               atol=2e-6)


def test_score_options_agree_with_numpy():
    """softcap, ALiBi slopes and learned sinks, per sequence, with a scale."""
    arrays, options = _call(np.random.default_rng(2), MIXED, 16)
    rng = np.random.default_rng(3)
    options.update(mask=masks.causal(), softcap=3.0, scale=0.3, return_lse=True,
                   alibi_slopes=jnp.asarray(rng.uniform(0.01, 0.2, (len(MIXED), HQ)),
                                            dtype=jnp.float32),
                   sinks=jnp.asarray(rng.standard_normal(HQ), dtype=jnp.float32))
    out, lse = portattn.paged_attention(*arrays, **options)
    want, want_lse = _on_numpy(arrays, options)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16])
def test_other_dtypes_agree_with_numpy(dtype):
    arrays, options = _call(np.random.default_rng(4), MIXED, 16, dtype=dtype)
    options.update(mask=masks.causal())
    out = portattn.paged_attention(*arrays, **options)
    want = _on_numpy(arrays, options)
    assert out.dtype == dtype
    tolerance = 1e-12 if dtype == jnp.float64 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(want, np.float64),
                               rtol=tolerance, atol=tolerance)


def test_a_nonfinite_value_reaches_only_the_rows_that_attend_it():
    sequences = [(1, 40), (2, 40), (1, 5)]
    arrays, options = _call(np.random.default_rng(5), sequences, 16, garbage=0.0)
    query, k_pool, v_pool = arrays
    table = np.asarray(options["block_table"])
    v_pool = v_pool.at[table[0, 2], 3].set(jnp.inf)  # key 35 of sequence 0
    v_pool = v_pool.at[table[1, 0], 0, 0, 0].set(jnp.nan)  # key 0 of sequence 1
    options.update(mask=masks.causal() & masks.sliding_window(10))
    out = np.asarray(portattn.paged_attention(query, k_pool, v_pool, **options))
    want = np.asarray(_on_numpy((query, k_pool, v_pool), options))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out[0]).all()  # sequence 0's query (position 39) sees key 35
    assert np.isfinite(out[1:]).all()  # sequence 1's window ends before key 0
    np.testing.assert_allclose(out[1:], want[1:], rtol=2e-5, atol=2e-6)


def test_a_query_that_sees_no_key_gives_zero_and_its_sink():
    arrays, options = _call(np.random.default_rng(6), [(2, 30), (1, 9)], 8)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], dtype=jnp.float32)
    # chunks of 4 positions: sequence 0's query at position 28 sees keys 28 and 29 only
    options.update(mask=masks.causal() & masks.chunks(4), return_lse=True)
    out, lse = portattn.paged_attention(*arrays, **options)
    want, want_lse = _on_numpy(arrays, options)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-5, atol=2e-6)
    _, lse = portattn.paged_attention(*arrays, **options, sinks=sinks)
    assert np.isfinite(np.asarray(lse)).all()


def test_a_decode_loop_compiles_a_few_times_not_once_a_step():
    """Sequences join and grow for 40 steps: tiles and table widths padded to powers of
    two, the chunks a traced bound, so the loop compiles for few shapes."""
    from portattn_jax._paged import _loop

    rng = np.random.default_rng(7)
    page, pool_pages = 16, 64
    k_pool = jnp.asarray(rng.standard_normal((pool_pages, page, HKV, D)), dtype=jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((pool_pages, page, HKV, DV)), dtype=jnp.float32)
    table = jnp.asarray(rng.permutation(pool_pages).reshape(8, 8).astype(np.int32))
    before = _loop._cache_size()
    for step in range(40):
        batch = 3 + step % 5  # 3 to 7 sequences
        lengths = jnp.asarray([20 + step + 2 * s for s in range(batch)])
        q = jnp.asarray(rng.standard_normal((batch, HQ, D)), dtype=jnp.float32)
        portattn.paged_attention(q, k_pool, v_pool, block_table=table[:batch],
                                 key_lengths=lengths, mask=masks.causal())
    assert _loop._cache_size() - before <= 2  # batches of 4 and of 8 tiles
