"""Decode steps of contiguous caches by the compiled paged loop (``_decode``): the
answers of the float64 reference for every shape, mask and layout it takes, the plan
for the calls it leaves, and its setting checked by name."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import masks

pytest.importorskip("numba", reason="the compiled decode loop needs Numba (portattn-numpy[jit])")

from portattn_numpy import _compiled_paged, configured, set_num_threads

MASKS = {
    "none": None,
    "causal": masks.causal(),
    "causal_top_left": masks.causal("top_left"),
    "window": masks.sliding_window(37, 5),
    "causal_window": masks.causal() & masks.sliding_window(100),
}
#: (batch, query heads, key/value heads, queries, keys): one query per head with work
#: for two threads, and a few queries, grouped or not
SHAPES = {
    "one_query_two_threads": (2, 8, 8, 1, 6144),
    "one_query_grouped": (2, 16, 4, 1, 4096),
    "few_queries": (3, 4, 4, 5, 300),
    "sixteen_queries_grouped": (1, 6, 2, 16, 200),
}


@pytest.fixture
def runs(monkeypatch):
    """How many calls the paged loop ran (with two threads, whatever the machine)."""
    set_num_threads(2)
    count = []
    forward = _compiled_paged.paged_forward

    def counted(*args, **kwargs):
        count.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(_compiled_paged, "paged_forward", counted)
    yield count
    set_num_threads(None)


def _inputs(shape, dtype, layout, seed=0):
    batch, hq, hkv, lq, lk = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, hq, lq, 32)).astype(dtype)
    k = rng.standard_normal((batch, hkv, lk, 32)).astype(dtype)
    v = rng.standard_normal((batch, hkv, lk, 24)).astype(dtype)
    if layout == "blhd":  # the caller's (batch, length, heads, dim) arrays
        q, k, v = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_steps_equal_the_reference(runs, shape, mask, layout):
    q, k, v = _inputs(SHAPES[shape], np.float32, layout)
    options = {"mask": MASKS[mask], "layout": layout, "return_lse": True, "softcap": 20.0}
    out, lse = portattn.attention(q, k, v, kernel="numpy_fast", **options)
    assert runs, "the call was planned, not run by the decode loop"
    want, want_lse = portattn.attention(*(x.astype(np.float64) for x in (q, k, v)),
                                        kernel="reference", **options)
    assert out.dtype == lse.dtype == np.float32
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)


def test_float64_is_as_exact_as_the_reference(runs):
    q, k, v = _inputs(SHAPES["few_queries"], np.float64, "bhld")
    out = portattn.attention(q, k, v, mask=masks.causal(), kernel="numpy_fast")
    assert runs
    want = portattn.attention(q, k, v, mask=masks.causal(), kernel="reference")
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["small_one_query", "more_queries", "bias", "not_positional",
                                  "setting_off", "hook"])
def test_the_plan_runs_what_the_loop_leaves(runs, case):
    """One query per head with one thread's work (the plan's stacked heads are as fast),
    more than 16 queries, a bias, a mask with arrays, the setting off, a tile hook."""
    shape = (1, 4, 4, 1, 64) if case == "small_one_query" else (1, 4, 4, 5, 300)
    if case == "more_queries":
        shape = (1, 4, 4, 17, 300)
    q, k, v = _inputs(shape, np.float32, "bhld")
    options = {"mask": masks.causal()}
    if case == "bias":
        options["bias"] = np.zeros((1, 1, shape[3], shape[4]), np.float32)
    if case == "not_positional":
        options["mask"] = masks.key_lengths(np.array([200]))
    settings = {"setting_off": {"compiled_decode": False},
                "hook": {"on_tile": lambda *_: None}}.get(case, {})
    with configured(**settings):
        out = portattn.attention(q, k, v, kernel="numpy_fast", **options)
    assert not runs
    want = portattn.attention(*(x.astype(np.float64) for x in (q, k, v)), kernel="reference",
                              **options)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_a_sequence_gives_the_same_bits_whatever_shares_its_batch(runs):
    q, k, v = _inputs((4, 8, 8, 3, 2048), np.float32, "bhld")
    batch = portattn.attention(q, k, v, mask=masks.causal(), kernel="numpy_fast")
    alone = portattn.attention(q[2:3], k[2:3], v[2:3], mask=masks.causal(),
                               kernel="numpy_fast")
    assert len(runs) == 2
    np.testing.assert_array_equal(batch[2:3], alone)


def test_a_bad_setting_is_named():
    with pytest.raises(ValueError, match="compiled_decode must be True or False; got "
                                         "compiled_decode='yes'"):
        configured(compiled_decode="yes").__enter__()
