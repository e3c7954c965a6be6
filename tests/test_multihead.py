"""Multi-head attention: GQA, cross-attention, the layer's construction and conversions,
and input errors (torch's nn.MultiheadAttention as the oracle: portattn-torch's tests)."""

from __future__ import annotations

import numpy as np
import pytest

from portattn import masks
from portattn.multihead import MultiHeadAttention, multi_head_attention
from portattn.testing import assert_close

D_MODEL, HEADS, L = 16, 4, 6


def random_params(rng, d_model=D_MODEL, heads=HEADS, kv_heads=HEADS, d_context=None,
                  head_dim=None):
    """Weights in the ``x @ W`` layout with non-zero biases, float64."""
    d_context = d_model if d_context is None else d_context
    head_dim = d_model // heads if head_dim is None else head_dim
    shapes = {"w_q": (d_model, heads * head_dim), "w_k": (d_context, kv_heads * head_dim),
              "w_v": (d_context, kv_heads * head_dim), "w_o": (heads * head_dim, d_model)}
    params = {n: rng.standard_normal(s) / np.sqrt(s[0]) for n, s in shapes.items()}
    params.update({"b" + n[1:]: 0.1 * rng.standard_normal(s[1]) for n, s in shapes.items()})
    return params


def on(backend, params, dtype="float32"):
    return {n: backend.asarray(a, dtype) for n, a in params.items()}


def repeat_kv_heads(params, heads, kv_heads):
    """The MHA weights whose head h uses GQA key/value head h // (heads // kv_heads)."""
    out = dict(params)
    for name in ("w_k", "w_v", "b_k", "b_v"):
        a = params[name]
        split = a.reshape(*a.shape[:-1], kv_heads, -1)
        out[name] = np.repeat(split, heads // kv_heads, axis=-2).reshape(*a.shape[:-1], -1)
    return out


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_gqa_equals_mha_with_repeated_kv_heads(backend, kv_heads):
    rng = np.random.default_rng(5)
    params = random_params(rng, kv_heads=kv_heads)
    x = rng.standard_normal((2, L, D_MODEL))
    out = multi_head_attention(backend.asarray(x, "float32"), **on(backend, params),
                               num_heads=HEADS, num_kv_heads=kv_heads, mask=masks.causal())
    expected = multi_head_attention(x, **repeat_kv_heads(params, HEADS, kv_heads),
                                    num_heads=HEADS, mask=masks.causal())
    assert_close(out, expected, "float32")


def reference_mha(x, params, heads, kv_heads, context):
    """Cross-attention written out in float64 NumPy, K/V heads repeated explicitly."""
    def split(a, h):
        return np.swapaxes(a.reshape(*a.shape[:-1], h, -1), -2, -3)

    q = split(x @ params["w_q"] + params["b_q"], heads)
    k = split(context @ params["w_k"] + params["b_k"], kv_heads)
    v = split(context @ params["w_v"] + params["b_v"], kv_heads)
    k, v = (np.repeat(a, heads // kv_heads, axis=-3) for a in (k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    o = (w / w.sum(axis=-1, keepdims=True)) @ v
    o = np.swapaxes(o, -2, -3).reshape(*x.shape[:-1], -1)
    return o @ params["w_o"] + params["b_o"]


def test_cross_attention_gqa_with_batch_dims(backend):
    rng = np.random.default_rng(6)
    params = random_params(rng, kv_heads=2, d_context=5, head_dim=3)
    x, context = rng.standard_normal((2, 3, L, D_MODEL)), rng.standard_normal((2, 3, 11, 5))
    out = multi_head_attention(backend.asarray(x, "float32"), **on(backend, params),
                               num_heads=HEADS, num_kv_heads=2,
                               context=backend.asarray(context, "float32"))
    assert tuple(out.shape) == (2, 3, L, D_MODEL)
    assert_close(out, reference_mha(x, params, HEADS, 2, context), "float32")


def test_init_gives_one_layer_everywhere(backend):
    layer = MultiHeadAttention.init(D_MODEL, HEADS, 2, seed=7, xp=backend.xp,
                                    device=backend.device)
    reference = MultiHeadAttention.init(D_MODEL, HEADS, 2, seed=7, dtype="float64")
    other_seed = MultiHeadAttention.init(D_MODEL, HEADS, 2, seed=8, dtype="float64")
    assert (layer.head_dim, layer.num_kv_heads) == (4, 2)
    assert set(layer.params) == {"w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"}
    for name, a in layer.params.items():
        got = backend.to_numpy(a)
        assert str(got.dtype) == "float32", name
        np.testing.assert_array_equal(got, reference.params[name].astype(np.float32))
        if name.startswith("w"):
            fan_in, fan_out = got.shape
            assert np.abs(got).max() <= np.sqrt(6 / (fan_in + fan_out))
            assert not np.array_equal(reference.params[name], other_seed.params[name])
        else:
            assert not got.any()


def test_layer_moves_between_libraries(backend):
    layer = MultiHeadAttention.init(8, 2, seed=9, dtype="float64")
    moved = layer.to(backend.xp, device=backend.device, dtype="float32")
    x = np.random.default_rng(10).standard_normal((1, 5, 8))
    assert_close(moved(backend.asarray(x, "float32"), mask=masks.causal()),
                 layer(x, mask=masks.causal()), "float32")


def test_bad_configuration(backend):
    kwargs = {"xp": backend.xp, "device": backend.device}
    with pytest.raises(ValueError, match=r"d_model=10 is not divisible by num_heads=4"):
        MultiHeadAttention.init(10, 4, **kwargs)
    with pytest.raises(ValueError, match=r"num_heads=4, num_kv_heads=3"):
        MultiHeadAttention.init(16, 4, 3, **kwargs)
    with pytest.raises(ValueError, match=r"num_heads=0"):
        MultiHeadAttention.init(16, 0, **kwargs)


def test_bad_inputs(backend):
    rng = np.random.default_rng(11)
    params = on(backend, random_params(rng))
    x = backend.asarray(rng.standard_normal((2, L, D_MODEL)), "float32")
    with pytest.raises(ValueError, match=r"num_heads=4, num_kv_heads=3"):
        multi_head_attention(x, **params, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"w_q.shape\[1\]=16 .* not divisible by num_heads=3"):
        multi_head_attention(x, **params, num_heads=3)
    wrong = dict(params, w_k=backend.asarray(np.ones((D_MODEL, 8)), "float32"))
    with pytest.raises(ValueError, match=r"w_k must have shape .*w_k.shape=\(16, 8\)"):
        multi_head_attention(x, **wrong, num_heads=HEADS)
    wrong = dict(params, b_o=backend.asarray(np.ones(3), "float32"))
    with pytest.raises(ValueError, match=r"b_o.shape=\(3,\)"):
        multi_head_attention(x, **wrong, num_heads=HEADS)
    narrow = backend.asarray(np.ones((2, L, 8)), "float32")
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., length, 16\).*\(2, 6, 8\)"):
        multi_head_attention(narrow, **params, num_heads=HEADS)
    with pytest.raises(ValueError, match=r"context must have shape .*\(2, 6, 8\)"):
        multi_head_attention(x, **params, num_heads=HEADS, context=narrow)
    if "float64" in backend.dtypes:
        with pytest.raises(TypeError, match=r"w_o.dtype=float64 differs from x.dtype=float32"):
            multi_head_attention(x, **dict(params, w_o=backend.asarray(np.ones((16, 16)))),
                                 num_heads=HEADS)


def test_context_from_another_library(backend):
    other = pytest.importorskip("array_api_strict" if backend.name == "numpy" else "numpy")
    layer = MultiHeadAttention.init(8, 2, xp=backend.xp, device=backend.device)
    x = backend.asarray(np.ones((1, 3, 8)), "float32")
    context = other.asarray(np.ones((1, 4, 8), dtype=np.float32))
    with pytest.raises(TypeError, match=r"context must come from x's library \(\w+\); got"):
        layer(x, context=context)
    with pytest.raises(TypeError, match=r"w_q must come from x's library"):
        layer(context)
