"""Every mask kind on both JAX kernels: the block form ``jax_flash`` reads (built on the
host, or on the device from traced arrays), masks as pytrees (``jit`` arguments,
``vmap``), no recompilation when only mask values change, and both kernels under
``jax.numpy_rank_promotion("raise")``."""

from __future__ import annotations

import numpy as np
import pytest
from jaxcases import Shapes, arrays, catalogue, jax_backend
from portattn_jax import JaxDpaKernel, JaxFlashKernel, register_mask_pytrees

import portattn
from portattn import masks
from portattn.testing import assert_close, oracle
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")
from portattn_jax._flash_tables import (  # noqa: E402
    device_states,
    device_tables,
    host_tables,
    per_element,
)

from portattn.kernel import describe  # noqa: E402

SHAPES = Shapes(batch=(2,), hq=4, hkv=2, lq=40, lk=40, d=8, dv=8)
NAMES = sorted(catalogue(np.asarray))


@pytest.fixture(autouse=True)
def _jax():
    jax_backend()
    register_mask_pytrees()


def _jax_mask(name):
    return catalogue(jax_backend().asarray)[name]


def test_both_kernels_declare_every_kind():
    assert JaxFlashKernel.masks == JaxDpaKernel.masks == frozenset(masks.KINDS)


@pytest.mark.parametrize(("block_q", "block_k"), [(8, 8), (16, 12)])
@pytest.mark.parametrize("name", NAMES)
def test_device_states_equal_the_host_block_form(name, block_q, block_k):
    # The same mask, its arrays traced (a jit argument): the states built on the device
    # must be the host's exact ones, merged over everything and per batch element.
    (q, k, v), _ = arrays(SHAPES, "float32")
    mask = _jax_mask(name)
    host = describe(q, k, v, mask=mask).blocks(block_q, block_k)

    @jax.jit
    def on_device(q, k, v, mask):
        inputs = describe(q, k, v, mask=mask)
        blocks = inputs.blocks(block_q, block_k)
        return device_states(inputs, blocks), device_states(inputs, blocks, SHAPES.batch)

    merged, each = (np.asarray(s) for s in on_device(q, k, v, mask))
    np.testing.assert_array_equal(merged, host.merged)
    np.testing.assert_array_equal(each, per_element(host.states, SHAPES.batch))
    for got, want in zip(device_tables(merged), host_tables(host), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    for got, want in zip(device_tables(each), host_tables(host, SHAPES.batch), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def _bound(name):
    (q, k, v), _ = arrays(SHAPES, "float32")
    return describe(q, k, v, mask=_jax_mask(name)).mask


@pytest.mark.parametrize("name", NAMES)
def test_only_arrays_are_leaves(name):
    bound = _bound(name)  # holds host copies of its arrays, block-form caches
    leaves, tree = jax.tree_util.tree_flatten(bound)
    assert len(leaves) == len(bound.arrays)
    assert all(a is b for a, b in zip(leaves, bound.arrays, strict=True))
    again = tree.unflatten([a + 0 if a.dtype != bool else ~~a for a in leaves])
    assert jax.tree_util.tree_structure(again) == tree
    assert again.structure() == bound.structure()


def test_a_mask_function_is_static_structure():
    mask = masks.function(lambda b, h, q, k: q >= k)
    other = masks.function(lambda b, h, q, k: q >= k)
    assert jax.tree_util.tree_leaves(mask) == []
    assert jax.tree_util.tree_structure(mask) == jax.tree_util.tree_structure(mask)
    assert jax.tree_util.tree_structure(mask) != jax.tree_util.tree_structure(other)


@pytest.mark.parametrize("kernel", ["jax_flash", "jax_dpa"])
@pytest.mark.parametrize("name", NAMES)
def test_every_kind_as_a_jit_argument(name, kernel):
    (q, k, v), np_args = arrays(SHAPES, "float32")
    attend = jax.jit(lambda q, k, v, m: portattn.attention(q, k, v, mask=m, kernel=kernel))
    want = oracle(*np_args, mask=catalogue(np.asarray)[name])[0]
    assert_close(attend(q, k, v, _jax_mask(name)), want, "float32")


VMAPPED = ["documents", "key_ranges", "prefix_lm", "global_per_batch", "function",
           "sequence_window"]


@pytest.mark.parametrize("name", VMAPPED)
def test_vmap_over_masks_with_per_example_arrays(name):
    # Each example gets its own lengths, ids or positions: the block form inside is
    # built from traced values.
    (q, k, v), np_args = arrays(SHAPES, "float32")
    one = jax.vmap(lambda q, k, v, m: portattn.attention(q, k, v, mask=m, kernel="jax_flash"))
    want = oracle(*np_args, mask=catalogue(np.asarray)[name])[0]
    assert_close(jax.jit(one)(q, k, v, _jax_mask(name)), want, "float32")


@pytest.fixture
def compilations():
    """Counts JAX's traces and backend compilations while the test runs."""
    events = []

    def listen(event, duration, **kwargs):
        if event in ("/jax/core/compile/backend_compile_duration",
                     "/jax/core/compile/jaxpr_trace_duration"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield events
    jax.monitoring.unregister_event_duration_listener(listen)


def _packed(seed):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, 40), 3, replace=False))
    return np.repeat(np.arange(4), np.diff(np.concatenate([[0], cuts, [40]])))[None]


def test_new_document_ids_reuse_the_compiled_loops(compilations):
    (q, k, v), np_args = arrays(Shapes(batch=(1,), lq=40, lk=40), "float32")

    def attend(ids):
        mask = masks.causal() & masks.documents(jnp.asarray(ids))
        return portattn.attention(q, k, v, mask=mask, kernel="jax_flash")

    attend(_packed(0))  # compiles
    compilations.clear()
    for seed in (1, 2, 3):
        ids = _packed(seed)
        got = attend(ids)
        assert_close(got, oracle(*np_args, mask=masks.causal() & masks.documents(ids))[0],
                     "float32")
    assert compilations == []


def test_masks_as_jit_arguments_trace_once(compilations):
    (q, k, v), _ = arrays(Shapes(batch=(1,), lq=40, lk=40), "float32")
    traces = []

    @jax.jit
    def step(q, k, v, mask):
        traces.append(1)
        def loss(q):
            return jnp.sum(portattn.attention(q, k, v, mask=mask, kernel="jax_flash") ** 2)
        return jax.grad(loss)(q)

    for seed in range(3):
        lengths = jnp.asarray(np.array([10 + 7 * seed]))
        ids = jnp.asarray(_packed(seed))
        step(q, k, v, masks.causal() & masks.documents(ids) & masks.key_lengths(lengths))
    assert len(traces) == 1


#: Mask functions are left out: the core's ``Function.bind`` probes one with index arrays
#: of different ranks (the array API broadcasts them).
RANKED = ["documents", "shared_documents", "key_lengths", "query_ranges", "window_or_global",
          "global_per_batch", "dense", "block_layout", "prefix_lm", "sequence_window"]


@pytest.mark.parametrize("kernel", ["jax_flash", "jax_dpa"])
@pytest.mark.parametrize("how", ["eager", "jit_argument"])
def test_no_implicit_rank_promotion(kernel, how):
    (q, k, v), _ = arrays(SHAPES, "float32")

    def loss(q, k, v, mask):
        return jnp.sum(portattn.attention(q, k, v, mask=mask, kernel=kernel))

    grad = jax.grad(loss, (0, 1, 2))
    if how == "jit_argument":
        grad = jax.jit(grad)
    with jax.numpy_rank_promotion("raise"):
        for name in RANKED:
            mask = _jax_mask(name)
            portattn.attention(q, k, v, mask=mask, kernel=kernel)
            grad(q, k, v, mask)
