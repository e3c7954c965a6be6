"""The portable flash backward against textbook gradients, on every backend.

The oracle is the plain attention formula differentiated by hand in float64 NumPy
(softmax of the masked scores, K/V repeated per query head); it shares no code with
the kernels but the mask's own dense tile and a score change's dense entries (which
``test_scores.py`` checks against entries written out pair by pair).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from portattn import dropout
from portattn._inputs import describe
from portattn._kernels import TiledKernel
from portattn.autograd import flash_backward, flash_forward
from portattn.testing import conformance_cases, to_numpy

#: (rtol, atol) for gradients of magnitude ~1: sums over a whole row or column of
#: tiles round more than one output does.
GRAD_TOLERANCES = {"float64": (1e-9, 1e-9), "float32": (1e-4, 1e-4),
                   "float16": (2e-2, 2e-2), "bfloat16": (1e-1, 1e-1)}

# Score functions (the cases "function" and "learned_softcap") have their textbook in
# test_score_functions.py: the one here adds a change's entries like a bias.
CASES = [c for c in conformance_cases(TiledKernel)
         if not c.weights and c.score_mod not in ("function", "learned_softcap")]
CASES += [replace(c, name=f"{c.name}_float64", dtype="float64") for c in CASES
          if c.name in {"basic", "softcap_small", "bias_full", "window_and_lengths",
                        "grouped_query_causal", "value_head_dim", "causal_and_dense"}]
CASES += [replace(CASES[0], name="long_gqa_softcap_bias", dtype="float64", hq=4, hkv=2,
                  lq=70, lk=600, softcap=2.0, bias="broadcast",
                  mask=(("sliding_window", 90, 5), ("key_lengths", (600, 123))))]


def textbook_grads(q, k, v, dout, dlse, *, mask, bias, scale, softcap, alibi_slopes=None,
                   sinks=None, dropped=None, entries=None):
    """``(dq, dk, dv, dbias, dsinks)`` of ``sum(out * dout) + sum(lse * dlse)``, by hand
    (ALiBi: ``-slope * |i + Lk - Lq - j|`` added to the scores; a sink: one more logit
    in each row's denominator; ``dropped``: the kept pairs over ``1 - p``, which
    multiply the weights after the softmax)."""
    group = q.shape[-3] // k.shape[-3]
    kr, vr = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    raw = q @ np.swapaxes(kr, -1, -2) * scale
    t = np.tanh(raw / softcap) if softcap else None
    s = softcap * t if softcap else raw
    if bias is not None:
        s = s + bias
    lq, lk = q.shape[-2], k.shape[-2]
    if alibi_slopes is not None:
        distance = np.abs(np.arange(lq)[:, None] + lk - lq - np.arange(lk)[None, :])
        s = s - alibi_slopes[..., None, None] * distance
    if entries is not None:  # a score change's, added like a bias
        s = s + entries
    allowed = np.ones(s.shape, dtype=bool)
    if mask is not None:
        bound = mask.bind(np, q.shape[:-3], q.shape[-3], lq, lk)
        allowed = np.broadcast_to(bound.tile(np, 0, lq, 0, lk, lq, lk), s.shape)
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    sink = None if sinks is None else sinks[..., None, None]
    if sink is not None:
        m = np.maximum(m, sink)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - m))
    p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    z = 1.0 if dropped is None else dropped
    out = (p * z) @ vr
    delta = (dout * out).sum(axis=-1, keepdims=True) - dlse[..., None]
    ds = p * ((dout @ np.swapaxes(vr, -1, -2)) * z - delta)
    dbias = None
    if bias is not None:
        dbias = ds.sum(axis=tuple(range(ds.ndim - bias.ndim)))
        dbias = dbias.sum(axis=tuple(i for i, n in enumerate(bias.shape) if n == 1),
                          keepdims=True)
    dx = ds * (1 - t * t) if softcap else ds
    dq = dx @ kr * scale
    dk = np.swapaxes(dx, -1, -2) @ q * scale
    dv = np.swapaxes(p * z, -1, -2) @ dout
    dk = dk.reshape((*k.shape[:-2], group, *k.shape[-2:])).sum(axis=-3)
    dv = dv.reshape((*v.shape[:-2], group, *v.shape[-2:])).sum(axis=-3)
    dsinks = None
    if sink is not None:  # d lse / d sink = its weight, d out / d sink = -weight * out
        dsinks = -(np.exp(sink - m) / total * delta).sum(axis=(-2, -1))
        dsinks = dsinks.sum(axis=tuple(range(dsinks.ndim - sinks.ndim)))
    return dq, dk, dv, dbias, dsinks


def _entries(np_args, np_kwargs):
    """The dense entries of a case's score change (None without one)."""
    change = np_kwargs.get("score_mod")
    return None if change is None else change.dense(np_args[0].shape[-2], np_args[1].shape[-2])


def _dropped(np_args, np_kwargs):
    """The kept pairs of a case with dropout, over ``1 - p`` (None without)."""
    p = np_kwargs.get("dropout_p")
    if not p:
        return None
    kept = dropout.mask(np_args[0], np_args[1], dropout_p=p,
                        dropout_seed=np_kwargs["dropout_seed"])
    return kept / (1.0 - p)


def assert_grad(actual, expected, dtype, what):
    got = np.asarray(to_numpy(actual), dtype=np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite gradient"
    rtol, atol = GRAD_TOLERANCES[dtype]
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_flash_backward_matches_textbook(case, backend):
    if case.dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {case.dtype}")
    args, kwargs, np_args, np_kwargs = case.build(backend)
    kwargs.pop("return_weights")
    inputs = describe(*args, **kwargs)
    out, lse = flash_forward(inputs)
    rng = np.random.default_rng(case.seed + 7)
    dout_np = rng.standard_normal(tuple(out.shape))
    dlse_np = rng.standard_normal(tuple(lse.shape))
    dout = backend.asarray(dout_np, case.dtype)
    dlse = backend.asarray(dlse_np, "float64" if case.dtype == "float64" else "float32")
    grads = flash_backward(inputs, out, lse, dout, dlse, bias_grad=case.bias is not None)
    want = textbook_grads(*np_args, np.asarray(to_numpy(dout), dtype=np.float64),
                          np.asarray(to_numpy(dlse), dtype=np.float64),
                          mask=np_kwargs.get("mask"), bias=np_kwargs.get("bias"),
                          scale=case.scale, softcap=case.softcap,
                          alibi_slopes=np_kwargs.get("alibi_slopes"),
                          sinks=np_kwargs.get("sinks"), dropped=_dropped(np_args, np_kwargs),
                          entries=_entries(np_args, np_kwargs))
    for name, got, expected, source in zip(("dq", "dk", "dv"), grads, want, args,
                                           strict=False):
        assert got.dtype == source.dtype, f"{name} dtype {got.dtype} != {source.dtype}"
        assert_grad(got, expected, case.dtype, name)
    if case.bias is not None:
        assert_grad(grads.bias, want[3].reshape(tuple(grads.bias.shape)), case.dtype, "dbias")
    else:
        assert grads.bias is None
    if case.sinks:
        assert_grad(grads.sinks, want[4].reshape(tuple(grads.sinks.shape)), case.dtype,
                    "dsinks")
    else:
        assert grads.sinks is None


def test_fully_masked_rows_get_zero_gradient(backend):
    from portattn import masks

    xp = backend.xp
    rng = np.random.default_rng(0)
    q, k, v = (backend.asarray(rng.standard_normal(s), "float32")
               for s in ((1, 2, 12, 8), (1, 2, 5, 8), (1, 2, 5, 8)))
    inputs = describe(q, k, v, mask=masks.causal())  # bottom-right: rows 0..6 see no key
    out, lse = flash_forward(inputs)
    dq, dk, dv, *_ = flash_backward(inputs, out, lse, xp.ones_like(out), xp.ones_like(lse))
    dq = to_numpy(dq)
    assert np.isfinite(dq).all()
    assert np.isfinite(to_numpy(dk)).all()
    assert np.isfinite(to_numpy(dv)).all()
    assert (dq[..., :7, :] == 0).all()
    assert (dq[..., 7:, :] != 0).any()


def test_into_adds_the_gradients_to_given_accumulators(backend):
    from portattn import masks

    dtype = "float64" if "float64" in backend.dtypes else "float32"
    rng = np.random.default_rng(3)
    shapes = ((1, 4, 40, 8), (1, 2, 300, 8), (1, 2, 300, 6))
    q, k, v = (backend.asarray(rng.standard_normal(s), dtype) for s in shapes)
    inputs = describe(q, k, v, mask=masks.causal() & masks.sliding_window(100))
    out, lse = flash_forward(inputs)
    dout = backend.asarray(rng.standard_normal(tuple(out.shape)), dtype)
    dlse = backend.asarray(rng.standard_normal(tuple(lse.shape)), dtype)
    plain = flash_backward(inputs, out, lse, dout, dlse)
    start = [rng.standard_normal(s) for s in shapes]
    into = tuple(backend.asarray(a.copy(), dtype) for a in start)  # may be added in place
    added = flash_backward(inputs, out, lse, dout, dlse, into=into)
    for name, got, base, grad in zip(("dq", "dk", "dv"), added, start, plain, strict=False):
        assert_grad(got, base + np.asarray(to_numpy(grad), dtype=np.float64), dtype, name)
