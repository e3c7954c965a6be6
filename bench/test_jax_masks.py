"""Block-sparse masks on JAX (CPU, float32), timed in turns in one run.

- Packed training: 8 documents of random lengths in one row of 4096 tokens,
  (1, 8, 4096, 64), ``causal() & documents(ids)`` (about a tenth of the pairs visible):
  ``jax.jit(jax.grad(loss))`` through portattn's dispatch (``jax_flash``, which skips
  the tiles across documents) against the same step through ``jax_flash`` with only
  ``causal()``. The ids are a constant of the jitted step, or one of its arguments
  (then the block form is built on the device from the traced ids). Target <= 0.35.
- Long context: ``sliding_window(512) | global_tokens(16 random positions)`` at
  L = 16384, forward, against the same call unmasked. Target: at most the share of
  pairs in the tiles the block form visits, plus 0.10.

Run: ``pytest -c pyproject.toml bench/test_jax_masks.py -p no:cacheprovider -s``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("portattn_jax")

import jax.numpy as jnp  # noqa: E402
from portattn_jax._flash_kernel import flash_plan  # noqa: E402

import portattn  # noqa: E402
from portattn import masks  # noqa: E402
from portattn.kernel import describe  # noqa: E402

FIGURES: dict[str, float] = {}
DOCS_LENGTH, DOCS, WINDOW_LENGTH, GLOBALS = 4096, 8, 16384, 16


@pytest.fixture(scope="module", autouse=True)
def report():
    portattn.kernels()  # discovered before tracing
    yield
    print("\nJAX mask figures:")
    for name, value in FIGURES.items():
        print(f"    {name}: {value:.3g}")


def _arrays(length, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((1, 8, length, 64), dtype=np.float32))
                 for _ in range(3))


def _packed_ids():
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, DOCS_LENGTH), DOCS - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [DOCS_LENGTH]]))
    return np.repeat(np.arange(DOCS), lengths)[None], lengths


def _visible(q, mask):
    """Share of the pairs in the tiles jax_flash visits for this call."""
    inputs = describe(q, q, q, mask=mask)
    plan = flash_plan(inputs)
    return inputs.blocks(plan.block_q, plan.block_k).visible


def _allowed(mask, length, rows=1024):
    """Share of the pairs a NumPy ``mask`` allows, counted in blocks of rows."""
    bound = mask.bind(np, (1,), 1, length, length)
    total = sum(int(bound.tile(np, r, min(r + rows, length), 0, length, length, length).sum())
                for r in range(0, length, rows))
    return total / length**2


def _loss(q, k, v, mask, kernel=None):
    return jnp.sum(portattn.attention(q, k, v, mask=mask, kernel=kernel) ** 2)


@pytest.mark.benchmark(group="jax masks")
@pytest.mark.parametrize("ids_as", ["constant", "argument"])
def test_packed_documents_training_step(benchmark, in_turns, ids_as):
    q, k, v = _arrays(DOCS_LENGTH)
    np_ids, lengths = _packed_ids()
    ids = jnp.asarray(np_ids)
    mask = masks.causal() & masks.documents(ids)
    assert portattn.explain(q, k, v, mask=mask).kernel.name == "jax_flash"
    # Each document alone, causal: what the packed call must give.
    out = jax.jit(lambda q, k, v, m: portattn.attention(q, k, v, mask=m))(q, k, v, mask)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = portattn.attention(q[..., part, :], k[..., part, :], v[..., part, :],
                                   mask=masks.causal(), kernel="jax_flash")
        np.testing.assert_allclose(np.asarray(out[..., part, :]), np.asarray(alone),
                                   rtol=2e-5, atol=2e-5)
        start += n

    grad = jax.grad(_loss, (0, 1, 2))
    if ids_as == "argument":
        step = jax.jit(lambda q, k, v, ids: grad(q, k, v, masks.causal() & masks.documents(ids)))
        args = (q, k, v, ids)
    else:
        step = jax.jit(lambda q, k, v: grad(q, k, v, mask))
        args = (q, k, v)
    causal = jax.jit(jax.grad(lambda q, k, v: _loss(q, k, v, masks.causal(), "jax_flash"),
                              (0, 1, 2)))
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    FIGURES[f"jit(grad) causal & documents (ids as {ids_as}): first call (compile + run), s"] = (
        time.perf_counter() - start)
    jax.block_until_ready(causal(q, k, v))  # compiled before timing
    best, median = in_turns(lambda: jax.block_until_ready(step(*args)),
                            lambda: jax.block_until_ready(causal(q, k, v)), rounds=7)
    name = f"jit(grad) causal & documents (ids as {ids_as}) / causal only"
    FIGURES[f"{name} (target <= 0.35), best"] = best
    FIGURES[f"{name}, median of rounds"] = median
    FIGURES["share of pairs visited: causal & documents"] = visible = _visible(q, mask)
    FIGURES["share of pairs visited: causal"] = _visible(q, masks.causal())
    benchmark.extra_info.update(ratio_best=best, ratio_median=median, target=0.35,
                                visible=visible)


@pytest.mark.benchmark(group="jax masks")
def test_window_with_global_tokens_forward(benchmark, in_turns):
    q, k, v = _arrays(WINDOW_LENGTH, seed=1)
    rng = np.random.default_rng(2)
    positions = jnp.asarray(np.sort(rng.choice(WINDOW_LENGTH, GLOBALS, replace=False)))
    mask = masks.sliding_window(512) | masks.global_tokens(positions)
    assert portattn.explain(q, k, v, mask=mask).kernel.name == "jax_flash"
    masked = jax.jit(lambda q, k, v: portattn.attention(q, k, v, mask=mask))
    full = jax.jit(lambda q, k, v: portattn.attention(q, k, v))
    jax.block_until_ready((masked(q, k, v), full(q, k, v)))  # compile both
    best, median = in_turns(lambda: jax.block_until_ready(masked(q, k, v)),
                            lambda: jax.block_until_ready(full(q, k, v)), rounds=3)
    # jax_flash runs the band and the global tokens apart: the target is the share of
    # pairs the mask allows, plus a tenth
    allowed = _allowed(masks.sliding_window(512) | masks.global_tokens(np.asarray(positions)),
                       WINDOW_LENGTH)
    name = "forward sliding_window(512) | global_tokens(16) / unmasked, L=16384"
    FIGURES[f"{name} (target <= {allowed + 0.1:.3f}), best"] = best
    FIGURES[f"{name}, median of rounds"] = median
    FIGURES["share of pairs allowed: window | global tokens"] = allowed
    benchmark.extra_info.update(ratio_best=best, ratio_median=median, target=allowed + 0.1,
                                allowed=allowed)
