"""Multi-head attention with an additive float mask and with key/value inputs of
different feature sizes (torch's kdim/vdim), against torch's nn.MultiheadAttention and
a direct computation."""

from __future__ import annotations

import re

import numpy as np
import pytest

from portattn import masks
from portattn.multihead import MultiHeadAttention, multi_head_attention
from portattn.testing import assert_close, oracle

E, HEADS, KDIM, VDIM = 12, 3, 7, 5


def layer(seed=0):
    return MultiHeadAttention.init(E, HEADS, kdim=KDIM, vdim=VDIM, seed=seed, dtype="float64")


def direct(lay, x, key_in, value_in, bias=None):
    p = lay.params

    def heads(a):
        return a.reshape(*a.shape[:-1], HEADS, -1).swapaxes(-2, -3)

    q, k, v = (heads(a @ p[w] + p[b]) for a, w, b in ((x, "w_q", "b_q"),
                                                       (key_in, "w_k", "b_k"),
                                                       (value_in, "w_v", "b_v")))
    out = oracle(q, k, v, bias=bias)[0].swapaxes(-2, -3)
    return out.reshape(*out.shape[:-2], -1) @ p["w_o"] + p["b_o"]


def test_kdim_vdim_and_float_mask(backend):
    rng = np.random.default_rng(1)
    x, key_in, value_in = (rng.standard_normal((2, n, d))
                           for n, d in ((4, E), (6, KDIM), (6, VDIM)))
    bias = rng.standard_normal((4, 6))
    bias[1, 2:] = -np.inf
    lay = layer()
    on = lay.to(backend.xp, device=backend.device, dtype="float32")
    got = on(backend.asarray(x, "float32"), context=backend.asarray(key_in, "float32"),
             value_context=backend.asarray(value_in, "float32"),
             mask=backend.asarray(bias, "float32"))
    assert_close(got, direct(lay, x, key_in, value_in, bias), "float32")
    as_bias = on(backend.asarray(x, "float32"), context=backend.asarray(key_in, "float32"),
                 value_context=backend.asarray(value_in, "float32"),
                 bias=backend.asarray(bias, "float32"))
    np.testing.assert_array_equal(backend.to_numpy(got), backend.to_numpy(as_bias))


def test_against_torch_multihead_attention():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, HEADS, kdim=KDIM, vdim=VDIM, batch_first=True,
                                      dtype=torch.float64).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    b = mha.in_proj_bias.detach().numpy()
    ours = MultiHeadAttention(
        mha.q_proj_weight.detach().numpy().T, mha.k_proj_weight.detach().numpy().T,
        mha.v_proj_weight.detach().numpy().T, mha.out_proj.weight.detach().numpy().T,
        b_q=b[:E], b_k=b[E:2 * E], b_v=b[2 * E:], b_o=mha.out_proj.bias.detach().numpy(),
        num_heads=HEADS)
    rng = np.random.default_rng(2)
    x, key_in, value_in = (rng.standard_normal((2, n, d))
                           for n, d in ((4, E), (6, KDIM), (6, VDIM)))
    float_mask = rng.standard_normal((4, 6))
    with torch.no_grad():
        want, _ = mha(*(torch.tensor(a) for a in (x, key_in, value_in)),
                      attn_mask=torch.tensor(float_mask), need_weights=False)
    got = ours(x, context=key_in, value_context=value_in, mask=float_mask)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)


def test_boolean_masks_still_select():
    lay = layer()
    rng = np.random.default_rng(3)
    x, key_in, value_in = (rng.standard_normal((1, n, d))
                           for n, d in ((3, E), (5, KDIM), (5, VDIM)))
    allowed = np.ones((3, 5), dtype=bool)
    allowed[:, 3:] = False
    got = lay(x, context=key_in, value_context=value_in, mask=allowed)
    np.testing.assert_allclose(got, lay(x, context=key_in[:, :3], value_context=value_in[:, :3]))
    assert masks.dense(allowed).kinds == {"dense"}


@pytest.mark.parametrize(("call", "text"), [
    (lambda lay, x, k, v: lay(x, context=k), "w_v.shape[0]=5 differs from w_k.shape[0]=7; "
     "pass value_context="),
    (lambda lay, x, k, v: lay(x, value_context=v), "w_k.shape[0]=7 differs from d_model=12"),
    (lambda lay, x, k, v: lay(x, context=k, value_context=v[:, :2]),
     "value_context must match context's batch dims and length; got context.shape=(1, 5, 7), "
     "value_context.shape=(1, 2, 5)"),
    (lambda lay, x, k, v: lay(x, context=k, value_context=k),
     "value_context must have shape (..., length, 5) to match w_v.shape[0]; "
     "got value_context.shape=(1, 5, 7)"),
    (lambda lay, x, k, v: lay(x, context=k, value_context=v, mask=np.zeros((3, 5)),
                              bias=np.zeros((3, 5))), "pass one of mask= and bias="),
])
def test_bad_inputs_name_the_argument(call, text):
    rng = np.random.default_rng(4)
    x, key_in, value_in = (rng.standard_normal((1, n, d))
                           for n, d in ((3, E), (5, KDIM), (5, VDIM)))
    with pytest.raises(ValueError, match=re.escape(text)):
        call(layer(), x, key_in, value_in)


def test_value_context_needs_context():
    lay = MultiHeadAttention.init(E, HEADS, vdim=VDIM, dtype="float64")
    x, v = np.zeros((1, 3, E)), np.zeros((1, 3, VDIM))
    with pytest.raises(ValueError, match="value_context needs context= too"):
        multi_head_attention(x, **lay.params, num_heads=HEADS, value_context=v)
