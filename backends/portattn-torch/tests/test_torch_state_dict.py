"""from_torch_state_dict / to_torch_state_dict: a portattn MultiHeadAttention on any
backend against torch's nn.MultiheadAttention holding the same weights.

The layers run on every selected backend while torch is the oracle: with NumPy
selected too (the ``cross`` tox env) these are cross-library tests.
"""

from __future__ import annotations

import numpy as np
import pytest
from portattn_torch import from_torch_state_dict, to_torch_state_dict

from portattn import MultiHeadAttention, masks
from portattn.testing import assert_close
from portattn.testing.plugin import require_library

torch = require_library("torch")
pytestmark = pytest.mark.cross

D_MODEL, HEADS, L = 16, 4, 6


def random_params(rng, d_model=D_MODEL, heads=HEADS, d_context=None):
    """Weights in the ``x @ W`` layout with non-zero biases, float64."""
    d_context = d_model if d_context is None else d_context
    head_dim = d_model // heads
    shapes = {"w_q": (d_model, heads * head_dim), "w_k": (d_context, heads * head_dim),
              "w_v": (d_context, heads * head_dim), "w_o": (heads * head_dim, d_model)}
    params = {n: rng.standard_normal(s) / np.sqrt(s[0]) for n, s in shapes.items()}
    params.update({"b" + n[1:]: 0.1 * rng.standard_normal(s[1]) for n, s in shapes.items()})
    return params


def torch_mha(params, heads, d_context=None):
    """An nn.MultiheadAttention (float64, CPU, batch_first) holding ``params``."""
    d_model = params["w_q"].shape[0]
    kdim = vdim = d_context
    module = torch.nn.MultiheadAttention(d_model, heads, batch_first=True, kdim=kdim,
                                         vdim=vdim, dtype=torch.float64)
    t = {n: torch.from_numpy(np.ascontiguousarray(a.T if a.ndim == 2 else a))
         for n, a in params.items()}
    sd = {"in_proj_bias": torch.cat([t["b_q"], t["b_k"], t["b_v"]]),
          "out_proj.weight": t["w_o"], "out_proj.bias": t["b_o"]}
    if d_context is None:
        sd["in_proj_weight"] = torch.cat([t["w_q"], t["w_k"], t["w_v"]])
    else:
        sd.update(q_proj_weight=t["w_q"], k_proj_weight=t["w_k"], v_proj_weight=t["w_v"])
    module.load_state_dict(sd)
    return module


def run_torch(module, x, context=None, causal=False, key_lengths=None):
    q = torch.from_numpy(x)
    kv = q if context is None else torch.from_numpy(context)
    attn_mask = key_padding = None
    if causal:
        attn_mask = torch.ones(q.shape[-2], kv.shape[-2], dtype=torch.bool).triu(1)
    if key_lengths is not None:
        key_padding = torch.arange(kv.shape[-2])[None, :] >= torch.from_numpy(key_lengths)[:, None]
    with torch.no_grad():
        out, _ = module(q, kv, kv, attn_mask=attn_mask, key_padding_mask=key_padding,
                        need_weights=False)
    return out.numpy()


@pytest.mark.parametrize("mask_kind", ["none", "causal", "key_padding", "causal+key_padding"])
def test_matches_torch_multihead_attention(backend, mask_kind):
    rng = np.random.default_rng(0)
    params = random_params(rng)
    module = torch_mha(params, HEADS)
    layer = from_torch_state_dict(
        module.state_dict(), HEADS, xp=backend.xp, device=backend.device, dtype="float32")
    x = rng.standard_normal((2, L, D_MODEL))
    lengths = np.array([L, 3])
    mask = None
    if "causal" in mask_kind:
        mask = masks.causal()
    if "key_padding" in mask_kind:
        padding = masks.key_lengths(backend.asarray(lengths))
        mask = padding if mask is None else mask & padding
    out = layer(backend.asarray(x, "float32"), mask=mask)
    expected = run_torch(module, x, causal="causal" in mask_kind,
                         key_lengths=lengths if "key_padding" in mask_kind else None)
    assert_close(out, expected, "float32")


def test_cross_attention_matches_torch(backend):
    rng = np.random.default_rng(1)
    params = random_params(rng, d_context=6)
    module = torch_mha(params, HEADS, d_context=6)
    layer = from_torch_state_dict(
        module.state_dict(), HEADS, xp=backend.xp, device=backend.device, dtype="float32")
    x, context = rng.standard_normal((2, L, D_MODEL)), rng.standard_normal((2, 9, 6))
    lengths = np.array([9, 4])
    out = layer(backend.asarray(x, "float32"), context=backend.asarray(context, "float32"),
                mask=masks.key_lengths(backend.asarray(lengths)))
    assert_close(out, run_torch(module, x, context, key_lengths=lengths), "float32")


def test_to_torch_state_dict_round_trip(backend):
    dtype = "float64" if "float64" in backend.dtypes else "float32"
    layer = MultiHeadAttention.init(D_MODEL, HEADS, seed=3, xp=backend.xp,
                                    device=backend.device, dtype=dtype)
    sd = to_torch_state_dict(layer)
    module = torch.nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True,
                                         dtype=getattr(torch, dtype))
    module.load_state_dict({n: t.cpu() for n, t in sd.items()})
    x = np.random.default_rng(4).standard_normal((2, L, D_MODEL))
    out = layer(backend.asarray(x, dtype), mask=masks.causal())
    expected = run_torch(module.double(), x, causal=True)
    assert_close(out, expected, dtype)
    back = from_torch_state_dict(sd, HEADS, xp=backend.xp,
                                                    device=backend.device)
    for name, a in layer.params.items():
        np.testing.assert_array_equal(backend.to_numpy(back.params[name]),
                                      backend.to_numpy(a), err_msg=name)


def test_to_torch_state_dict_without_bias(backend):
    layer = MultiHeadAttention.init(8, 2, bias=False, xp=backend.xp, device=backend.device)
    sd = to_torch_state_dict(layer)
    assert set(sd) == {"in_proj_weight", "out_proj.weight"}
    module = torch.nn.MultiheadAttention(8, 2, bias=False, batch_first=True)
    module.load_state_dict({n: t.cpu() for n, t in sd.items()})  # strict: same keys


def test_bad_configuration(backend):
    layer = MultiHeadAttention.init(16, 4, 2, xp=backend.xp, device=backend.device)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 != num_heads=4"):
        to_torch_state_dict(layer)
    with pytest.raises(ValueError, match=r"'in_proj_weight'.*got keys \['weight'\]"):
        from_torch_state_dict({"weight": layer.params["w_q"]}, 4)
