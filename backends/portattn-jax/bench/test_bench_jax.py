"""jax_dpa against tiled and against calling jax.nn.dot_product_attention directly.

float32, shapes (1, 8, N, 64) for N = 256, 1024, with and without a causal mask, each
call compiled once with ``jax.jit`` (what JAX users run) and timed after a warm-up
call. ``direct`` is JAX's own function on (B, L, H, D) arrays: the gap to ``jax_dpa``
is the cost of the wrapper (layout changes, the fix for rows without keys). On CPU,
dispatch leaves calls above ``JaxDpaKernel.xla_score_limit_cpu`` scores to ``tiled``;
these figures are what that limit rests on, so it is lifted here. Run::

    pytest -c pyproject.toml backends/portattn-jax/bench -p no:cacheprovider
"""

from __future__ import annotations

import numpy as np
import pytest
from portattn_jax import JaxDpaKernel

import portattn
from portattn import masks

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

SIZES = (256, 1024)
HEADS, HEAD_DIM = 8, 64
IMPLS = ("direct", "jax_dpa", "tiled")


@pytest.fixture(autouse=True)
def _no_cpu_limit(monkeypatch):
    monkeypatch.setattr(JaxDpaKernel, "xla_score_limit_cpu", JaxDpaKernel.xla_score_limit)


def _call(impl: str, n: int, causal: bool):
    rng = np.random.default_rng(n)
    q, k, v = (jnp.asarray(rng.standard_normal((1, HEADS, n, HEAD_DIM), dtype=np.float32))
               for _ in range(3))
    if impl == "direct":
        q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal))
    else:
        mask = masks.causal() if causal else None
        fn = jax.jit(lambda q, k, v: portattn.attention(q, k, v, mask=mask, kernel=impl))
    fn(q, k, v).block_until_ready()  # compile outside the timing
    return lambda: fn(q, k, v).block_until_ready()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", SIZES)
def test_attention_speed(benchmark, impl, n, causal):
    benchmark.group = f"N={n} {'causal' if causal else 'full'}"
    benchmark.extra_info["gflop"] = 4 * HEADS * n * n * HEAD_DIM / (2 if causal else 1) / 1e9
    benchmark.pedantic(_call(impl, n, causal), rounds=5, warmup_rounds=1)
