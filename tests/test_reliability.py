"""Regression tests: every kernel of every backend gives the same answer where kernels
used to disagree (each test forces every kernel that targets the backend in turn)."""

from __future__ import annotations

import numpy as np
import pytest
from fuzz_oracle import attention64

import portattn
from portattn import masks
from portattn.errors import KernelNotUsableError
from portattn.kernel import ANY
from portattn.testing import tolerance
from portattn.testing.plugin import require_library


def _kernels(backend):
    return [e.name for e in portattn.kernels() if e.kernel is not None and (
        e.kernel.namespaces == ANY or backend.namespace in e.kernel.namespaces)]


def every_kernel(backend, args, want, dtype="float32", **kwargs):
    """Force each kernel; return how many ran. Fails listing every kernel that differs."""
    rtol, atol = tolerance(dtype)
    ran, wrong = 0, []
    for name in _kernels(backend):
        try:
            out = portattn.attention(*args, kernel=name, **kwargs)
            got = np.asarray(backend.to_numpy(out), dtype=np.float64)
        except KernelNotUsableError:
            continue
        ran += 1
        if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
            wrong.append(f"{name}: off by {np.max(np.abs(got - want), initial=0):.3g}")
    assert not wrong, "\n".join(wrong)
    return ran


def _arrays(backend, shapes, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    arrays = tuple(backend.asarray(rng.standard_normal(s), dtype) for s in shapes)
    return arrays, [np.asarray(backend.to_numpy(a), dtype=np.float64) for a in arrays]


@pytest.mark.parametrize("scale", [-1e4, -0.5, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_any_finite_scale(backend, scale, causal):
    args, seen = _arrays(backend, [(2, 3, 7, 8)] * 3)
    allowed = np.tril(np.ones((7, 7), bool)) if causal else None
    want, _ = attention64(*seen, allowed, None, scale, None)
    if scale == 0.0 and not causal:
        np.testing.assert_allclose(want, np.broadcast_to(seen[2].mean(-2, keepdims=True),
                                                         want.shape))
    mask = masks.causal() if causal else None
    assert every_kernel(backend, args, want, scale=scale, mask=mask) >= 2
    out = portattn.scaled_dot_product_attention(*args, scale=scale, is_causal=causal)
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_inputs_add_a_float32_bias_as_given(backend, dtype):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    args, seen = _arrays(backend, [(2, 2, 9, 16)] * 3, dtype)
    bias = np.random.default_rng(3).standard_normal((2, 2, 9, 9)) * 100
    want, _ = attention64(*seen, None, bias, None, None)
    every_kernel(backend, args, want, dtype, bias=backend.asarray(bias, "float32"))


def test_unsigned_lengths_do_not_wrap_in_restrict(backend):
    args, seen = _arrays(backend, [(2, 2, 6, 8), (2, 2, 20, 8), (2, 2, 20, 8)])
    lengths = np.array([3, 17], dtype=np.uint8)
    whole = masks.key_lengths(backend.asarray(lengths))
    part = whole.restrict(backend.xp, 0, 6, 8, 20, 6, 20)  # keys 8..19 of 20
    allowed = (np.arange(8, 20) < lengths.astype(int)[:, None, None, None])
    q, k, v = args
    want, _ = attention64(seen[0], seen[1][..., 8:, :], seen[2][..., 8:, :],
                          np.broadcast_to(allowed, (2, 2, 6, 12)), None, None, None)
    every_kernel(backend, (q, k[..., 8:, :], v[..., 8:, :]), want, mask=part)
    every_kernel(backend, args, attention64(
        *seen, np.arange(20) < lengths.astype(int)[:, None, None, None], None, None, None)[0],
        mask=whole)


@pytest.mark.parametrize("mask", ["causal_br", "causal_tl", "window"])
@pytest.mark.parametrize("block", [(0, 6, 0, 9), (6, 12, 4, 16), (3, 9, 10, 16)])
def test_restricted_masks_give_the_block_of_the_whole(backend, mask, block):
    lq, lk = 12, 16
    q0, q1, k0, k1 = block
    args, seen = _arrays(backend, [(2, 2, lq, 8), (2, 2, lk, 8), (2, 2, lk, 8)])
    whole = {"causal_br": masks.causal(), "causal_tl": masks.causal("top_left"),
             "window": masks.sliding_window(3, 1)}[mask]
    i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
    full = {"causal_br": j <= i + lk - lq, "causal_tl": j <= i,
            "window": (j >= i + lk - lq - 3) & (j <= i + lk - lq + 1)}[mask]
    q, k, v = args
    want, _ = attention64(seen[0][..., q0:q1, :], seen[1][..., k0:k1, :],
                          seen[2][..., k0:k1, :], full[q0:q1, k0:k1], None, None, None)
    part = whole.restrict(backend.xp, q0, q1, k0, k1, lq, lk)
    every_kernel(backend, (q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :]), want,
                 mask=part)


def test_dense_masks_of_different_ranks_with_query_lengths(backend):
    args, seen = _arrays(backend, [(2, 3, 5, 4)] * 3)
    rng = np.random.default_rng(1)
    a, b = rng.random((3, 1, 5)) < 0.7, rng.random((2, 1, 1, 5)) < 0.7
    qlen = np.array([3, 5])
    mask = (masks.dense(backend.asarray(a)) & masks.dense(backend.asarray(b))
            & masks.query_lengths(backend.asarray(qlen)))
    allowed = a & b & (np.arange(5)[:, None] < qlen[:, None, None, None])
    want, _ = attention64(*seen, allowed, None, None, None)
    assert every_kernel(backend, args, want, mask=mask) >= 2


ZERO_SIZE = [((0, 2, 5, 8), (0, 2, 4, 8)), ((2, 0, 5, 8), (2, 1, 4, 8)),
             ((2, 2, 0, 8), (2, 2, 4, 8)), ((2, 2, 5, 8), (2, 2, 0, 8)),
             ((3, 0, 2, 5, 8), (3, 0, 2, 4, 8)), ((1, 2, 1, 0, 64), (1, 2, 1, 3, 64))]


@pytest.mark.parametrize(("q_shape", "kv_shape"), ZERO_SIZE, ids=lambda s: str(s))
def test_zero_size_shapes(backend, q_shape, kv_shape, request):
    args, seen = _arrays(backend, [q_shape, kv_shape, kv_shape])
    want, _ = attention64(*seen, None, None, None, None)
    every_kernel(backend, args, want, mask=masks.causal())


@pytest.mark.parametrize(("q_shape", "kv_shape"), ZERO_SIZE, ids=lambda s: str(s))
def test_zero_size_shapes_get_zero_gradients(backend, q_shape, kv_shape):
    """As torch's SDPA does: an empty call is still part of the graph."""
    if backend.namespace != "torch":
        pytest.skip(f"{backend.name}: the empty calls' gradients are checked through torch")
    import torch

    args, _ = _arrays(backend, [q_shape, kv_shape, kv_shape])
    ran = 0
    for e in portattn.kernels():
        if e.kernel is None or not e.kernel.grad:
            continue
        leaves = [a.detach().requires_grad_(True) for a in args]
        try:
            out = portattn.attention(*leaves, mask=masks.causal(), kernel=e.name)
        except KernelNotUsableError:
            continue
        grads = torch.autograd.grad(out.sum(), leaves)
        assert all(g.shape == a.shape and not g.any() for g, a in zip(grads, args, strict=True))
        ran += 1
    assert ran >= 2  # tiled and reference at least


def test_zero_batch_with_lengths(backend, request):
    args, _ = _arrays(backend, [(0, 2, 5, 8)] * 3)
    mask = masks.key_lengths(backend.asarray(np.zeros((0,), dtype=np.int64)))
    want = np.zeros((0, 2, 5, 8))
    assert every_kernel(backend, args, want, mask=mask) >= 2


@pytest.mark.cross  # two libraries: runs in the cross tox env (numpy + torch)
def test_borrowing_carries_what_dlpack_could_not():
    """Byte order is part of a NumPy dtype and DLPack cannot carry a swapped one: the
    description takes such arrays in the machine's order, so a kernel borrowing through
    DLPack runs them; 0-d and shared length arrays are borrowed correctly."""
    require_library("torch")
    require_library("portattn_torch", backend="torch")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 5, 4)).astype(np.float32) for _ in range(3))
    swapped = k.astype(k.dtype.newbyteorder())
    plan = portattn.explain(q, swapped, v)
    assert plan.inputs.key.dtype.isnative
    assert dict((e.name, w) for e, w in plan.candidates)["torch_sdpa_dlpack"] == ()
    want, _ = attention64(q, k, v, None, None, None, None)
    out = portattn.attention(q, swapped, v, kernel="torch_sdpa_dlpack")
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    lengths = np.array(3)  # batch shape (): 0-d, and used by two masks
    mask = (masks.key_lengths(lengths) & masks.query_lengths(lengths)).restrict(
        np, 0, 5, 1, 5, 5, 5)
    allowed = (np.arange(1, 5) < 3) & (np.arange(5)[:, None] < 3)
    want, _ = attention64(q, k[:, 1:], v[:, 1:], np.broadcast_to(allowed, (2, 5, 4)), None,
                          None, None)
    out = portattn.attention(q, k[:, 1:], v[:, 1:], mask=mask, kernel="torch_sdpa_dlpack")
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


JIT_AFTER_DISCOVERY = """
import portattn
from portattn import masks
portattn.kernels()  # the plugins load before JAX is imported
import jax
import jax.numpy as jnp
q = jnp.ones((2, 2, 4, 8))
attend = jax.jit(lambda q, mask: portattn.attention(q, q, q, mask=mask))
print(attend(q, masks.causal() & masks.key_lengths(jnp.array([2, 3]))).shape)
"""


JIT_WITHOUT_DISCOVERY = """
import jax
import jax.numpy as jnp
import portattn
from portattn import masks
q = jnp.ones((2, 2, 4, 8))
attend = jax.jit(lambda q, mask: portattn.attention(q, q, q, mask=mask))
print(attend(q, masks.causal() & masks.key_lengths(jnp.array([2, 3]))).shape)
"""


@pytest.mark.parametrize("script", [JIT_AFTER_DISCOVERY, JIT_WITHOUT_DISCOVERY],
                         ids=["kernels_discovered_before_jax", "no_kernel_discovered"])
def test_masks_are_jit_arguments_without_a_call_to_remember(script):
    import subprocess
    import sys

    pytest.importorskip("portattn_jax")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("(2, 2, 4, 8)")


def test_a_failing_library_hook_warns_and_masks_are_still_built(monkeypatch):
    from portattn._lib import LibraryParts, _plugins
    from portattn.errors import PluginWarning

    def broken():
        msg = "no hook today"
        raise RuntimeError(msg)

    monkeypatch.setattr(_plugins, "_names", ("numpy",))
    monkeypatch.setattr(_plugins, "_parts", {"numpy": LibraryParts(on_import=broken)})
    monkeypatch.setattr(_plugins, "_hooked", set())
    with pytest.warns(PluginWarning, match=r"on_import of numpy failed: RuntimeError"):
        mask = masks.causal()
    assert mask.kind == "causal"
    masks.causal()  # tried once: no second warning (warnings are errors here)


def _entry_points(*found):
    """An ``entry_points(group=...)`` that knows only ``found``."""
    return lambda group: [ep for ep in found if ep.group == group]


def test_one_entry_point_gives_a_library_its_parts_and_old_groups_still_count(monkeypatch):
    from importlib.metadata import EntryPoint

    from portattn._lib import _plugins

    monkeypatch.setattr(_plugins, "_parts", {})
    monkeypatch.setattr(_plugins, "entry_points", _entry_points(
        EntryPoint("newlib", "types:SimpleNamespace", "portattn.libraries"),
        EntryPoint("oldlib", "json", "portattn.seeds"),
        EntryPoint("oldlib", "math:sqrt", "portattn.autograd"),
        EntryPoint("both", "json", "portattn.libraries"),
        EntryPoint("both", "math", "portattn.seeds"),
    ))
    import json
    import math

    assert _plugins.parts_for("oldlib").seeds is json  # read for a release
    assert _plugins.parts_for("oldlib").attach_autograd is math.sqrt
    assert _plugins.parts_for("newlib").seeds is None  # a part it does not add
    assert _plugins.parts_for("both").seeds is None  # the new group wins: json has none
    assert _plugins.parts_for("nolib") == _plugins.LibraryParts()


def test_a_library_entry_point_that_fails_to_load_warns_once(monkeypatch):
    from importlib.metadata import EntryPoint

    from portattn._lib import _plugins
    from portattn.errors import PluginWarning

    monkeypatch.setattr(_plugins, "_parts", {})
    monkeypatch.setattr(_plugins, "entry_points", _entry_points(
        EntryPoint("brokenlib", "no_such_module_here", "portattn.libraries")))
    with pytest.warns(PluginWarning, match="portattn.libraries brokenlib.*ModuleNotFoundError"):
        assert _plugins.parts_for("brokenlib").attach_autograd is None
    assert _plugins.attach_for("brokenlib") is None  # remembered: no second warning


# dynamo warns about array-api-compat's lru_caches and torch's own deprecations
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_torch_compile_fullgraph(backend):
    if backend.namespace != "torch":
        pytest.skip("torch.compile compiles torch code only")
    import torch

    args, seen = _arrays(backend, [(2, 2, 8, 16)] * 3)
    mask = masks.causal()  # (built inside: test_torch_compile_first_call)
    portattn.kernels()  # discovered before compiling, as the README says
    compiled = torch.compile(lambda q, k, v: portattn.attention(q, k, v, mask=mask),
                             fullgraph=True)
    want, _ = attention64(*seen, np.tril(np.ones((8, 8), bool)), None, None, None)
    out = compiled(*args)
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=2e-5, atol=2e-5)


def test_big_endian_arrays_are_taken_in_the_machines_order():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 6, 4)) for _ in range(3))
    bias = rng.standard_normal((6, 6))
    want = portattn.attention(q, k, v, bias=bias, mask=masks.causal(), return_lse=True)
    swapped = [a.astype(a.dtype.newbyteorder(">")) for a in (q, k, v, bias)]
    for chosen in ([0], [2], [0, 1, 2, 3]):  # the query only, the value only, all
        args = [swapped[i] if i in chosen else a for i, a in enumerate((q, k, v, bias))]
        for entry in portattn.kernels():
            if entry.kernel is None or entry.kernel.available() is not None or (
                    "numpy" not in entry.kernel.namespaces and entry.kernel.namespaces != "*"):
                continue
            try:
                out, lse = portattn.attention(*args[:3], bias=args[3], mask=masks.causal(),
                                              return_lse=True, kernel=entry.name)
            except KernelNotUsableError:  # refused for what it does not declare, say
                continue
            np.testing.assert_allclose(out, want[0], rtol=1e-12, err_msg=entry.name)
            np.testing.assert_allclose(lse, want[1], rtol=1e-12, err_msg=entry.name)
