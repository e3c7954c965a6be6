"""``return_max_scores``: each query row's largest score after every change, over the
keys the mask lets it see, on every backend and whichever kernel runs the call,
against the scores written out in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest

import portattn
from portattn import masks, scores
from portattn.testing import to_numpy
from portattn.testing.plugin import require_backend

B, H, HKV, LQ, LK, D = 2, 4, 2, 12, 9, 8
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-2}


def call(backend, dtype, **options):
    """The arrays of one call on ``backend`` and, as float64 NumPy, what it holds."""
    rng = np.random.default_rng(0)
    given = {"q": rng.standard_normal((B, H, LQ, D)), "k": rng.standard_normal((B, HKV, LK, D)),
             "bias": rng.standard_normal((H, LQ, LK)), "slopes": rng.uniform(0.1, 0.5, H),
             "table": rng.standard_normal((16, H))}
    on = {n: backend.asarray(a, dtype) for n, a in given.items()}
    held = {n: to_numpy(a).astype(np.float64) for n, a in on.items()}
    return on, held


def written_out(held):
    """Row maxima of the scores pair by pair: Lq > Lk, so under the causal mask the
    first rows see no key; the window leaves distances 0, 1 and 2, which T5's 16
    one-directional buckets hold one each (bucket = distance)."""
    k = np.repeat(held["k"], H // HKV, axis=1)
    s = held["q"] @ np.swapaxes(k, -1, -2) / math.sqrt(D)
    s = 4.0 * np.tanh(s / 4.0) + held["bias"]
    i = np.arange(LQ)[:, None] + LK - LQ
    j = np.arange(LK)[None, :]
    s = s - held["slopes"][:, None, None] * np.abs(i - j)
    s = s + np.moveaxis(held["table"][np.clip(i - j, 0, 15)], -1, 0)
    return np.where((j <= i) & (i - j <= 2), s, -np.inf).max(axis=-1)


def options(on):
    return {"mask": masks.causal() & masks.sliding_window(2), "bias": on["bias"],
            "softcap": 4.0,
            "score_mod": scores.relative_position(on["table"], bidirectional=False,
                                                  max_distance=12)
            + scores.alibi(on["slopes"])}


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_row_maxima_follow_the_scores(backend, dtype):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    on, held = call(backend, dtype)
    _, lse, top = portattn.attention(on["q"], on["k"], on["k"], return_lse=True,
                                       return_max_scores=True, **options(on))
    assert top.shape == lse.shape
    assert top.dtype == lse.dtype
    want, got = written_out(held), to_numpy(top).astype(np.float64)
    assert np.isinf(want[..., :LQ - LK]).all()  # rows that see no key
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])


def test_whichever_kernel_runs_the_call():
    on, held = call(require_backend("numpy"), "float32")
    q = on["q"]
    want = (held["q"] @ np.swapaxes(held["q"], -1, -2) / math.sqrt(D)).max(axis=-1)
    for kernel in (None, "reference", "tiled"):
        _, top = portattn.attention(q, q, q, return_max_scores=True, kernel=kernel)
        np.testing.assert_allclose(top, want, rtol=1e-5, atol=1e-5)
    assert not isinstance(portattn.attention(q, q, q), tuple)


def test_a_constant_under_torch_autograd_and_jax_grad():
    torch_backend = require_backend("torch")
    on, held = call(torch_backend, "float64")
    leaves = {n: a.clone().requires_grad_() for n, a in on.items()}
    out, top = portattn.attention(leaves["q"], leaves["k"], leaves["k"],
                                  return_max_scores=True, **options(leaves))
    assert not top.requires_grad
    out.sum().backward()  # the gradients of out are untouched by the extra output
    assert leaves["table"].grad is not None
    np.testing.assert_allclose(top.numpy(), written_out(held), rtol=1e-12, atol=1e-12)


def test_under_jax_jit():
    jax_backend = require_backend("jax")
    import jax

    on, held = call(jax_backend, "float64")

    def loss(q, k, table):
        given = {**on, "table": table}
        out, top = portattn.attention(q, k, k, return_max_scores=True, **options(given))
        return out.sum(), top

    (_, top), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2),
                                                     has_aux=True))(on["q"], on["k"],
                                                                    on["table"])
    assert all(bool(jax.numpy.isfinite(g).all()) for g in grads)
    np.testing.assert_allclose(np.asarray(top), written_out(held), rtol=1e-12, atol=1e-12)


def test_the_flag_is_checked():
    q = np.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="return_max_scores must be True or False"):
        portattn.attention(q, q, q, return_max_scores="yes")
