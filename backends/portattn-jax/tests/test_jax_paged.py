"""Paged calls on JAX run ``jax_flash``'s compiled loop: dispatch gives them to it (on
the CPU unless ``numpy_fast`` is installed, which it defers to there), it
answers as the same call on NumPy does for every option (the NumPy paged path is
checked against the float64 oracle in the core suite), a value it may not read never
reaches a result, and a decode loop compiles a few times, not once a step. Under
``jax.jit``, with the table, lengths and starts traced, the same holds, and a jitted
decode step compiles once."""

from __future__ import annotations

from functools import partial

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


# --- under jax.jit: the table, lengths and starts traced, the tiles planned on the device

#: MIXED with a sequence that has no key yet.
WITH_EMPTY = [*MIXED, (0, 0)]
#: Options the jitted call takes as static arguments; the rest (arrays) are traced.
STATIC = ("mask", "layout", "scale", "softcap", "return_lse", "cascade")


@partial(jax.jit, static_argnames=STATIC)
def _paged_jit(query, key_pages, value_pages, traced, *, mask=None, layout="blhd",
               scale=None, softcap=None, return_lse=False, cascade=False):
    return portattn.paged_attention(query, key_pages, value_pages, **traced, mask=mask,
                                    layout=layout, scale=scale, softcap=softcap,
                                    return_lse=return_lse, cascade=cascade)


def _jitted(arrays, options):
    """``paged_attention`` of ``arrays`` and ``options`` under ``jax.jit``, every array
    (the table, lengths and starts among them) traced; one compile per shape."""
    static = {k: v for k, v in options.items() if k in STATIC}
    traced = {k: v for k, v in options.items() if k not in STATIC}
    return _paged_jit(*arrays, traced, **static)


@pytest.mark.parametrize(("page", "layout", "mask", "scores"), [
    (16, "blhd", WINDOW_SINKS, False), (1, "bhld", masks.causal(), True)],
    ids=["window_sinks-16", "causal_scores-1-bhld"])
def test_under_jit_agrees_with_numpy(page, layout, mask, scores):
    """Prefills and decodes, a sequence with no query and one with no key, NaN in every
    slot no sequence holds; with softcap, ALiBi slopes per sequence and sinks."""
    arrays, options = _call(np.random.default_rng(9), WITH_EMPTY, page, layout,
                            garbage=np.nan)
    options.update(mask=mask, return_lse=True)
    if scores:
        rng = np.random.default_rng(10)
        options.update(softcap=3.0, scale=0.3, sinks=jnp.asarray(
            rng.standard_normal(HQ), dtype=jnp.float32), alibi_slopes=jnp.asarray(
            rng.uniform(0.01, 0.2, (len(WITH_EMPTY), HQ)), dtype=jnp.float32))
    out, lse = _jitted(arrays, options)
    want, want_lse = _on_numpy(arrays, options)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-5, atol=2e-6)


def _window_sinks_call(rng):
    """The call of ``test_under_jit_agrees_with_numpy[window_sinks-16]``: its
    shapes and options, so a test that reuses them compiles nothing more."""
    arrays, options = _call(rng, WITH_EMPTY, 16, garbage=np.nan)
    options.update(mask=WINDOW_SINKS, return_lse=True)
    return arrays, options


def test_under_jit_a_nonfinite_value_reaches_only_the_rows_that_attend_it():
    arrays, options = _window_sinks_call(np.random.default_rng(11))
    query, k_pool, v_pool = arrays
    table = np.asarray(options["block_table"])
    v_pool = v_pool.at[table[0, 18], 5].set(jnp.inf)  # key 293 of sequence 0 (300 keys)
    out, _ = _jitted((query, k_pool, v_pool), options)
    want, _ = _on_numpy((query, k_pool, v_pool), options)
    out, want = np.asarray(out), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out[0]).all()  # sequence 0's one query (position 299) sees it
    np.testing.assert_allclose(out[1:], want[1:], rtol=2e-5, atol=2e-6)


def test_under_jit_values_the_eager_call_refuses_make_their_sequences_rows_nan():
    """They cannot raise under a trace: a sequence with more queries than keys, one
    longer than its table row, one whose table names a page outside the pool."""
    arrays, options = _window_sinks_call(np.random.default_rng(12))
    starts, lengths, table = (np.array(options[name]) for name in (
        "query_starts", "key_lengths", "block_table"))
    lengths[4] = 6  # 7 queries
    lengths[6] = table.shape[1] * 16 + 1
    table[7, 1] = arrays[1].shape[0]  # one page past the pool, within its 90 keys
    refused = np.zeros(starts[-1], dtype=bool)
    for s in (4, 6, 7):
        refused[starts[s]:starts[s + 1]] = True
    out, lse = _jitted(arrays, {**options, "key_lengths": jnp.asarray(lengths),
                                "block_table": jnp.asarray(table)})
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isnan(out[refused]).all()
    assert np.isnan(lse[:, refused]).all()
    want, _ = _on_numpy(arrays, options)
    np.testing.assert_allclose(out[~refused], np.asarray(want)[~refused], rtol=2e-5,
                               atol=2e-6)
    # starts that do not run from 0 to T: every row
    starts[-1] -= 1
    out, _ = _jitted(arrays, {**options, "query_starts": jnp.asarray(starts)})
    assert np.isnan(np.asarray(out)).all()


def test_a_jitted_decode_loop_compiles_once_whatever_its_lengths():
    """Lengths that change every step are traced values of one shape; ``cascade`` is
    ignored under the trace, to the same result."""
    rng = np.random.default_rng(13)
    page, pool_pages, batch = 16, 64, 6
    k_pool = jnp.asarray(rng.standard_normal((pool_pages, page, HKV, D)), dtype=jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((pool_pages, page, HKV, DV)), dtype=jnp.float32)
    table = jnp.asarray(rng.permutation(pool_pages)[:batch * 8].reshape(batch, 8),
                        dtype=jnp.int32)
    traces = []

    @jax.jit
    def step(q, k_pool, v_pool, table, lengths):  # the pools as arguments, as a server has
        traces.append(1)  # runs when jit traces the function: once per compile
        return portattn.paged_attention(q, k_pool, v_pool, block_table=table,
                                        key_lengths=lengths, mask=masks.causal(),
                                        cascade=True)

    for i in range(12):
        lengths = jnp.asarray([1 + i * 9 + 5 * s for s in range(batch)], dtype=jnp.int32)
        q = jnp.asarray(rng.standard_normal((batch, HQ, D)), dtype=jnp.float32)
        out = step(q, k_pool, v_pool, table, lengths)
    eager = portattn.paged_attention(q, k_pool, v_pool, block_table=table,
                                     key_lengths=lengths, mask=masks.causal())
    np.testing.assert_allclose(np.asarray(out), np.asarray(eager), rtol=2e-5, atol=2e-6)
    assert len(traces) == 1


def test_explain_paged_under_jit_says_the_tiles_are_planned_on_the_device():
    arrays, options = _call(np.random.default_rng(14), MIXED, 16)
    options.pop("layout")
    seen = []

    def explain(query, key_pages, value_pages, traced):
        seen.append(portattn.explain_paged(query, key_pages, value_pages, **traced,
                                           mask=masks.causal()))
        return query

    jax.eval_shape(explain, *arrays, options)  # traces, compiles nothing
    plan = seen[0]
    assert plan.kernel.name == "jax_flash"
    text = str(plan)
    assert (f"8 sequences, {arrays[0].shape[0]} queries; block_table, key_lengths, "
            f"query_starts traced: the query tiles are planned on the device") in text
    assert "cascade=True would: nothing: block_table, key_lengths, query_starts traced" \
        in text


def test_under_jit_no_query_gives_empty_results():
    arrays, options = _call(np.random.default_rng(15), [(0, 5), (0, 30)], 16)
    out, lse = _jitted(arrays, {**options, "return_lse": True})
    assert out.shape == (0, HQ, DV)
    assert lse.shape == (HQ, 0)
