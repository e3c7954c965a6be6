"""``jax_flash`` as a loop program: tiles skipped, a program size independent of the
sequence length, transformations, dispatch, and the edge cases of its backward."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from jaxcases import Shapes, arrays, jax_backend, mask_pair
from portattn_jax import JaxFlashKernel, register_mask_pytrees

import portattn
from portattn import masks
from portattn.testing import assert_close, oracle
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")
from portattn_jax._flash_call import backward_all, forward_all  # noqa: E402
from portattn_jax._flash_kernel import flash_plan, flat_arguments, per_batch  # noqa: E402
from textbook import allowed_of, textbook  # noqa: E402

from portattn.kernel import describe  # noqa: E402


@pytest.fixture(autouse=True)
def _jax():
    jax_backend()
    register_mask_pytrees()


def _tiles_visited(mask, np_mask, lq=64, lk=64, block=8, traced=False):
    """Tiles the forward and the backward visit, and the tiles holding an allowed pair;
    ``traced``: the mask is an argument of the jitted loops (its block form is built on
    the device)."""
    backend = jax_backend()
    rng = np.random.default_rng(0)
    q, k, v = (backend.asarray(rng.standard_normal((2, 2, n, 4)), "float32")
               for n in (lq, lk, lk))

    def loops(plan, *args):
        out, lse, fwd_tiles = forward_all(plan, *args)
        *_, bwd_tiles = backward_all(plan, *args, out, lse, jnp.ones_like(out), None, False)
        return fwd_tiles, bwd_tiles

    def run(q, k, v, mask):
        inputs = describe(q, k, v, mask=mask)
        plan = replace(flash_plan(inputs), block_q=block, block_k=block,
                       per_batch=per_batch(inputs))
        return jax.jit(loops, static_argnums=0)(plan, *flat_arguments(inputs, plan))

    fwd_tiles, bwd_tiles = (jax.jit(run) if traced else run)(q, k, v, mask)
    allowed = allowed_of(np_mask, (2,), 2, lq, lk).any(axis=1)  # union over heads
    if not per_batch(describe(q, k, v, mask=mask)):
        allowed = allowed.any(axis=0, keepdims=True)  # and over the batch
    nonempty = allowed.reshape(-1, lq // block, block, lk // block, block).any(axis=(2, 4))
    total = len(allowed) * (lq // block) * (lk // block)
    return int(fwd_tiles), int(bwd_tiles), int(nonempty.sum()), total


def _documents(conv):
    # increasing runs (every block holds all the ids between its smallest and largest)
    ids = np.repeat(np.arange(5), [13, 20, 4, 19, 8])[None].repeat(2, 0)
    ids[1] = np.repeat(np.arange(3), [30, 30, 4])
    return masks.causal() & masks.documents(conv(ids))


SKIPPING = {
    "causal": lambda conv: masks.causal(),
    "causal_top_left_cross": lambda conv: masks.causal("top_left"),
    "window": lambda conv: masks.sliding_window(8, 0),
    "causal_and_key_lengths": lambda conv: masks.causal() & masks.key_lengths(
        conv(np.array([20, 9]))),
    "query_lengths": lambda conv: masks.query_lengths(conv(np.array([17, 30]))),
    "documents": _documents,
    "window_or_global": lambda conv: masks.sliding_window(8) | masks.global_tokens(
        conv(np.array([3, 40]))),
    "chunks": lambda conv: masks.chunks(16),
    "key_ranges": lambda conv: masks.key_ranges(conv(np.array([9, 30])),
                                                conv(np.array([33, 50]))),
    "function": lambda conv: masks.function(lambda b, h, q, k: (q >= k) & (q - k < 12), args=()),
}


@pytest.mark.parametrize("traced", [False, True], ids=["host", "jit_argument"])
@pytest.mark.parametrize("name", sorted(SKIPPING))
def test_only_tiles_with_allowed_pairs_are_visited(name, traced):
    backend = jax_backend()
    make = SKIPPING[name]
    fwd, bwd, nonempty, total = _tiles_visited(make(backend.asarray), make(np.asarray),
                                               traced=traced)
    assert fwd == bwd == nonempty < total
    if name == "causal":
        assert nonempty == 8 * 9 // 2  # the diagonal and below: about half of full


def test_key_lengths_are_skipped_at_run_time():
    # The lengths are traced arguments: the tiles visited follow their values, each
    # batch element's own.
    backend = jax_backend()
    for lengths in ([8, 3], [40, 17], [64, 64], [0, 9]):
        mask = masks.key_lengths(backend.asarray(np.array(lengths)))
        fwd, bwd, nonempty, _ = _tiles_visited(mask, masks.key_lengths(np.array(lengths)),
                                               traced=True)
        assert fwd == bwd == nonempty == 8 * sum(-(-n // 8) for n in lengths)


def _equations(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _equations(inner)
    return total


PROGRAM_MASKS = {
    "causal_and_key_lengths": lambda n, a: masks.causal() & masks.key_lengths(a["lengths"]),
    "documents": lambda n, a: masks.causal() & masks.documents(a["ids"]),
    "window_or_global": lambda n, a: masks.sliding_window(512) | masks.global_tokens(
        a["positions"]),
    "function": lambda n, a: masks.function(lambda b, h, q, k: (q >= k) & (q - k < 300),
                                            args=()),
}


@pytest.mark.parametrize("name", sorted(PROGRAM_MASKS))
def test_jitted_grad_of_a_long_masked_call_is_a_small_program(name):
    def loss(q, k, v, arrays):
        mask = PROGRAM_MASKS[name](q.shape[-2], arrays)
        return jnp.sum(portattn.attention(q, k, v, mask=mask, kernel="jax_flash") ** 2)

    sizes = {}
    for n in (512, 8192):  # traced only: nothing of this size is allocated
        shape = jax.ShapeDtypeStruct((1, 8, n, 64), jnp.float32)
        arrays = {"lengths": jax.ShapeDtypeStruct((1,), jnp.int32),
                  "ids": jax.ShapeDtypeStruct((1, n), jnp.int32),
                  "positions": jax.ShapeDtypeStruct((16,), jnp.int32)}
        jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(shape, shape, shape, arrays)
        sizes[n] = _equations(jaxpr.jaxpr)
    assert sizes[512] == sizes[8192] < 1000, sizes


def test_large_causal_call_dispatches_to_jax_flash():
    q = jnp.zeros((1, 8, 4096, 64), jnp.float32)
    mask = masks.causal() & masks.key_lengths(jnp.array([4000]))
    plan = portattn.explain(q, q, q, mask=mask)
    assert plan.kernel.name == "jax_flash", str(plan)
    why = dict((e.name, w) for e, w in plan.candidates)["jax_dpa"]
    assert any("score matrix" in w for w in why), why


@pytest.mark.parametrize("kwargs", [{"return_lse": True}, {"softcap": 2.0}, {}],
                         ids=["return_lse", "softcap", "float64"])
def test_what_jax_dpa_refuses_goes_to_jax_flash(kwargs):
    dtype = "float32" if kwargs else "float64"
    (q, k, v), _ = arrays(Shapes(), dtype)
    assert portattn.explain(q, k, v, mask=masks.causal(), **kwargs).kernel.name == "jax_flash"
    (q, k, v), _ = arrays(Shapes(), "float32")
    assert portattn.explain(q, k, v, mask=masks.causal()).kernel.name == "jax_dpa"


@pytest.mark.parametrize("mask_name", ["causal_and_key_lengths", "dense"])
def test_vmap_of_grad_and_mask_as_jit_argument(mask_name):
    shapes = Shapes(lq=11, lk=13)
    (q, k, v), np_args = arrays(shapes, "float32")
    mask, np_mask = mask_pair(mask_name, shapes)

    def one(q, k, v, m):  # one batch element: lengths of shape ()
        return portattn.attention(q, k, v, mask=m, kernel="jax_flash")

    got = jax.jit(jax.vmap(one))(q, k, v, mask)
    assert_close(got, oracle(*np_args, mask=np_mask)[0], "float32")

    def loss(q, k, v, m):
        return jnp.sum(portattn.attention(q, k, v, mask=m, kernel="jax_flash") ** 2)

    per_example = jax.jit(jax.vmap(jax.grad(loss, (0, 1, 2))))(q, k, v, mask)
    whole = jax.grad(loss, (0, 1, 2))(q, k, v, mask)  # eager; the loss sums over batch
    for a, b in zip(per_example, whole, strict=True):
        assert_close(a, np.asarray(b, np.float64), "float32", "vmapped gradient")


def test_fully_masked_rows_get_zero_gradient_and_no_nan():
    shapes = Shapes(lq=9, lk=4)  # bottom-right causal: the first 5 rows see no key
    (q, k, v), _ = arrays(shapes, "float64")
    lengths = jnp.asarray(np.array([0, 3]))
    mask = masks.causal() & masks.key_lengths(lengths)

    def loss(q, k, v):
        out, lse = portattn.attention(q, k, v, mask=mask, return_lse=True, kernel="jax_flash")
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    dq, dk, dv = jax.grad(loss, (0, 1, 2))(q, k, v)
    _, lse = portattn.attention(q, k, v, mask=mask, return_lse=True, kernel="jax_flash")
    empty = np.isneginf(np.asarray(lse))
    assert empty[0].all()
    assert empty[1, :, :5].all()
    assert not empty[1, :, 5:].any()
    for g in (dq, dk, dv):
        assert np.isfinite(np.asarray(g)).all()
    assert not np.asarray(dq)[empty].any()
    assert not np.asarray(dk)[0].any()
    assert not np.asarray(dv)[0].any()


@pytest.mark.parametrize(("lq", "lk"), [(0, 5), (4, 0)])
def test_empty_sequences_under_grad(lq, lk):
    (q, k, v), _ = arrays(Shapes(lq=lq, lk=lk), "float32")

    def loss(q, k, v):
        out, lse = portattn.attention(q, k, v, return_lse=True, kernel="jax_flash")
        assert out.shape == (2, 4, lq, 8)
        assert lse.shape == (2, 4, lq)
        return jnp.sum(out)

    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    for g, a in zip(grads, (q, k, v), strict=True):
        assert g.shape == a.shape
        assert not np.asarray(g).any()


@pytest.mark.parametrize("bias_shape", [(3, 1, 1, 7), (7,), (2, 3, 1, 5, 1)],
                         ids=["partial_batch", "keys_only", "per_query"])
def test_bias_gradient_keeps_the_broadcast_shape(bias_shape):
    backend = jax_backend()
    rng = np.random.default_rng(3)
    dims = ((2, 3, 4, 5, 8), (2, 3, 2, 7, 8), (2, 3, 2, 7, 6))
    q, k, v = (backend.asarray(rng.standard_normal(s), "float64") for s in dims)
    bias = backend.asarray(rng.standard_normal(bias_shape), "float64")
    lengths = np.array([[7, 3, 0], [5, 7, 2]])
    mask = masks.causal("top_left") & masks.key_lengths(backend.asarray(lengths))
    allowed = allowed_of(masks.causal("top_left") & masks.key_lengths(lengths), (2, 3), 4, 5, 7)

    def flash(q, k, v, bias, mask):
        return jnp.sum(portattn.attention(q, k, v, mask=mask, bias=bias, kernel="jax_flash")
                       ** 2)

    def reference(q, k, v, bias):
        return jnp.sum(textbook(q, k, v, allowed=allowed, bias=bias)[0] ** 2)

    got = jax.jit(jax.grad(flash, 3))(q, k, v, bias, mask)
    want = jax.grad(reference, 3)(q, k, v, bias)
    assert got.shape == bias.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9, atol=1e-10)


def test_block_sizes_follow_the_tile_budget():
    from portattn_jax._flash_layout import block_sizes

    limit, budget = JaxFlashKernel.max_block, JaxFlashKernel.tile_elements
    assert block_sizes(8, 8192, 8192, limit, budget) == (256, 256)
    assert block_sizes(64 * 16, 8192, 8192, limit, budget) == (16, 256)
    assert block_sizes(8, 7, 5, limit, budget) == (7, 5)


def test_nan_in_padding_reaches_neither_output_nor_gradients():
    backend = jax_backend()
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 2, 6, 8)) for _ in range(3))
    k[0, :, 4:] = v[0, :, 4:] = np.nan  # keys past key_lengths[0]
    q[1, :, 3:] = np.nan  # queries past query_lengths[1]
    q, k, v = (backend.asarray(a, "float64") for a in (q, k, v))
    mask = (masks.key_lengths(backend.asarray(np.array([4, 6])))
            & masks.query_lengths(backend.asarray(np.array([6, 3]))))

    def loss(q, k, v, mask):
        return jnp.sum(portattn.attention(q, k, v, mask=mask, kernel="jax_flash"))

    out = portattn.attention(q, k, v, mask=mask, kernel="jax_flash")
    assert np.isfinite(np.asarray(out)).all()
    for g in jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v, mask):
        assert np.isfinite(np.asarray(g)).all()


def test_zero_size_batch_with_lengths():
    z = jnp.zeros((0, 2, 5, 8))
    mask = masks.key_lengths(jnp.zeros((0,), jnp.int32))
    out, lse = portattn.attention(z, z, z, mask=mask, return_lse=True, kernel="jax_flash")
    assert out.shape == (0, 2, 5, 8)
    assert lse.shape == (0, 2, 5)
