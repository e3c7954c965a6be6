"""ALiBi and learned attention sinks on every backend, against the formulas written out.

ALiBi (flash-attn's definition) adds ``-slope * |i + Lk - Lq - j|`` to the score of
query ``i`` and key ``j``; a sink (gpt-oss) is one more logit per head in each row's
softmax denominator, attending no value. The oracle here is plain float64 NumPy.
"""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.kernel import Kernel
from portattn.testing import assert_close, to_numpy


def textbook(q, k, v, *, alibi_slopes=None, sinks=None, causal=False):
    """float64 ``(out, lse)`` of the formula, row by row."""
    *batch, hq, lq, d = q.shape
    lk = k.shape[-2]
    group = hq // k.shape[-3]
    out = np.zeros((*batch, hq, lq, v.shape[-1]))
    lse = np.full((*batch, hq, lq), -np.inf)
    for index in np.ndindex(*batch, hq):
        *b, h = index
        kv = (*b, h // group)
        for i in range(lq):
            scores = [q[index][i] @ k[kv][j] / np.sqrt(d) for j in range(lk)]
            if alibi_slopes is not None:
                slope = alibi_slopes[(*b, h)] if alibi_slopes.ndim > 1 else alibi_slopes[h]
                scores = [s - slope * abs(i + lk - lq - j) for j, s in enumerate(scores)]
            allowed = [not causal or j <= i + lk - lq for j in range(lk)]
            logits = [s for s, a in zip(scores, allowed, strict=True) if a]
            if sinks is not None:
                logits.append(sinks[h])
            if not logits:
                continue
            top = max(logits)
            total = sum(np.exp(s - top) for s in logits)
            lse[index][i] = top + np.log(total)
            for j in range(lk):
                if allowed[j]:
                    out[index][i] += np.exp(scores[j] - lse[index][i]) * v[kv][j]
    return out, lse


@pytest.fixture
def arrays():
    rng = np.random.default_rng(3)
    shapes = ((2, 4, 7, 8), (2, 2, 11, 8), (2, 2, 11, 6))
    return [rng.standard_normal(s) for s in shapes], rng


@pytest.mark.parametrize("kernel", ["tiled", "reference"])
@pytest.mark.parametrize(("alibi", "sinks", "causal"), [
    ("heads", False, False), ("batch_heads", False, True), (None, True, False),
    (None, True, True), ("heads", True, True)])
def test_alibi_and_sinks_follow_the_formula(backend, arrays, kernel, alibi, sinks, causal):
    (q, k, v), rng = arrays
    slopes = {"heads": rng.uniform(0.05, 0.5, 4), "batch_heads": rng.uniform(0.05, 0.5, (2, 4)),
              None: None}[alibi]
    sink = rng.uniform(-1, 2, 4) if sinks else None
    want_out, want_lse = textbook(q, k, v, alibi_slopes=slopes, sinks=sink, causal=causal)
    dtype = "float32"
    args = [backend.asarray(a, dtype) for a in (q, k, v)]
    options = {name: backend.asarray(a, dtype) for name, a in
               (("alibi_slopes", slopes), ("sinks", sink)) if a is not None}
    if causal:
        options["mask"] = masks.causal()
    out, lse = portattn.attention(*args, return_lse=True, kernel=kernel, **options)
    assert_close(out, want_out, dtype, "out")
    assert_close(lse, want_lse, dtype, "lse")


def test_a_row_that_sees_no_key_keeps_its_sink(backend, arrays):
    (q, k, v), rng = arrays
    q = np.concatenate([q, q], axis=-2)  # 14 queries over 11 keys: 3 rows see nothing
    sink = rng.uniform(-1, 2, 4)
    out, lse = portattn.attention(*(backend.asarray(a, "float32") for a in (q, k, v)),
                                  mask=masks.causal(), sinks=backend.asarray(sink, "float32"),
                                  return_lse=True)
    out, lse = to_numpy(out), to_numpy(lse)
    assert (out[..., :3, :] == 0).all()
    np.testing.assert_allclose(lse[..., :3], np.broadcast_to(sink[:, None], (2, 4, 3)),
                               rtol=1e-6)


def test_sinks_gradient_flows_through_attention(backend, arrays):
    (q, k, v), rng = arrays
    sink = rng.uniform(-1, 2, 4)
    step = 1e-6
    if backend.name == "torch":
        import torch

        tensors = [torch.tensor(a, requires_grad=True) for a in (q, k, v, sink)]
        out = portattn.attention(*tensors[:3], sinks=tensors[3], mask=masks.causal())
        out.square().sum().backward()
        got = tensors[3].grad.numpy()
        tolerance = 1e-5
    elif backend.name == "jax":  # float32: JAX's default
        import jax

        arrays32 = [backend.asarray(a, "float32") for a in (q, k, v)]

        def loss(z):
            return (portattn.attention(*arrays32, sinks=z, mask=masks.causal()) ** 2).sum()

        got = np.asarray(jax.grad(loss)(backend.asarray(sink, "float32")))
        tolerance = 1e-3
    else:
        pytest.skip(f"{backend.name} has no autograd")
    want = [(np.square(textbook(q, k, v, sinks=sink + step * e, causal=True)[0]).sum()
             - np.square(textbook(q, k, v, sinks=sink - step * e, causal=True)[0]).sum())
            / (2 * step) for e in np.eye(4)]
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance / 100)


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"alibi_slopes": np.ones(3)}, ValueError,
     r"alibi_slopes must have shape \(Hq,\) = \(4,\) or \(\*batch, Hq\) = \(2, 4\); "
     r"got alibi_slopes.shape=\(3,\)"),
    ({"sinks": np.ones(4, dtype=np.int64)}, TypeError,
     "sinks must have a real floating dtype; got sinks.dtype=int64"),
    ({"sinks": [0.0] * 4}, TypeError, "sinks must be an array of the query's library"),
])
def test_bad_alibi_and_sinks_are_named(arrays, options, error, message):
    (q, k, v), _ = arrays
    with pytest.raises(error, match=message):
        portattn.attention(q, k, v, **options)


def test_alibi_slopes_take_no_gradient():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 2, 3, 4)
    says = (r"alibi_slopes are constants .* alibi_slopes.detach\(\), or learn them with "
            r"score_mod=portattn.scores.alibi\(slopes\)")
    with pytest.raises(ValueError, match=says):
        portattn.attention(q, q, q, alibi_slopes=torch.ones(2, requires_grad=True))


def test_a_kernel_that_does_not_declare_them_refuses():
    class Plain(Kernel):
        name = "plain"
        namespaces = devices = "*"
        dtypes = frozenset({"float64"})

    from portattn._inputs import describe

    q = np.zeros((1, 2, 3, 4))
    reasons = Plain.not_supported_reasons(describe(q, q, q, alibi_slopes=np.ones(2),
                                                   sinks=np.zeros(2)))
    assert reasons == ["alibi_slopes not supported", "sinks not supported"]
