"""Gradients through the masks of long-context and packed training, against
``jax.grad`` of the textbook formula in float64: packed documents, a sliding window
with global tokens, a mask function, with a bias and a softcap; the mask given to
``jax.jit`` as an argument (its arrays traced) and as a constant of the function.

``jax_flash`` runs in float64 (its gradients must match to rounding), also with small
blocks (each batch element then skips its own tiles); ``jax_dpa``, which computes in
float32, in float32.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from jaxcases import Shapes, arrays, jax_backend
from portattn_jax import JaxFlashKernel, register_mask_pytrees

import portattn
from portattn import masks
from portattn.testing.plugin import require_library

jax = require_library("jax")
jnp = require_library("jax.numpy")
from textbook import allowed_of, textbook, weighted_loss  # noqa: E402

SHAPES = Shapes(batch=(2,), hq=4, hkv=2, lq=37, lk=37, d=8, dv=8)
IDS = np.stack([np.repeat(np.arange(4), [9, 14, 6, 8]), np.repeat(np.arange(3), [20, 10, 7])])
IDS[1, -4:] = -1  # padding at the end of the second row


def _near(b, h, q, k):
    return (q >= k) & (q - k <= 5 + 2 * h)


MASKS = {
    "documents": lambda c: masks.causal() & masks.documents(c(IDS)),
    "window_or_global": lambda c: masks.sliding_window(4, 1) | masks.global_tokens(
        c(np.array([2, 30]))),
    "function": lambda c: masks.function(_near, args=()),
}
#: (mask, bias, softcap) of each case
CASES = {"documents": ("documents", True, None),
         "window_or_global_softcap": ("window_or_global", False, 2.0),
         "function_bias_softcap": ("function", True, 3.0)}
TOLERANCE = {"jax_flash": ("float64", 1e-9, 1e-10), "jax_dpa": ("float32", 2e-4, 2e-4)}
#: (kernel, case, largest block): jax_dpa takes no softcap; jax_flash also with blocks
#: of 8, where each batch element runs with its own block tables
RUNS = [(kernel, case, block) for kernel in TOLERANCE for case in sorted(CASES)
        for block in ((None, 8) if kernel == "jax_flash" else (None,))
        if kernel == "jax_flash" or CASES[case][2] is None]


@pytest.fixture(autouse=True)
def _jax():
    jax_backend()
    register_mask_pytrees()


@pytest.mark.parametrize("how", ["jit_argument", "jit_constant"])
@pytest.mark.parametrize(("kernel", "case", "block"), RUNS,
                         ids=[f"{k}-{c}" + (f"-blocks_of_{b}" if b else "") for k, c, b in RUNS])
def test_gradients_match_the_float64_textbook(kernel, case, how, block):
    name, with_bias, softcap = CASES[case]
    dtype, rtol, atol = TOLERANCE[kernel]
    backend = jax_backend()
    (q, k, v), np_args = arrays(SHAPES, dtype, seed=5)
    rng = np.random.default_rng(6)
    bias64 = rng.standard_normal((SHAPES.hq, SHAPES.lq, SHAPES.lk)) if with_bias else None
    bias = None if bias64 is None else backend.asarray(bias64, dtype)
    mask = MASKS[name](backend.asarray)
    allowed = allowed_of(MASKS[name](np.asarray), SHAPES.batch, SHAPES.hq, SHAPES.lq,
                         SHAPES.lk)
    w_out = rng.standard_normal((*SHAPES.batch, SHAPES.hq, SHAPES.lq, SHAPES.dv))
    w_lse = rng.standard_normal((*SHAPES.batch, SHAPES.hq, SHAPES.lq))
    with_lse = kernel == "jax_flash"

    def loss(q, k, v, bias, mask):
        got = portattn.attention(q, k, v, mask=mask, bias=bias, softcap=softcap,
                                 return_lse=with_lse, kernel=kernel)
        out, lse = got if with_lse else (got, jnp.zeros(w_lse.shape, got.dtype))
        return weighted_loss(out, lse, w_out.astype(out.dtype), w_lse.astype(lse.dtype))

    def reference(q, k, v, bias):
        out, lse = textbook(q, k, v, allowed=allowed, bias=bias, softcap=softcap)
        return weighted_loss(out, lse if with_lse else jnp.zeros_like(lse), w_out, w_lse)

    argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    with mock.patch.object(JaxFlashKernel, "max_block", block or JaxFlashKernel.max_block):
        if how == "jit_argument":
            got = jax.jit(jax.grad(loss, argnums))(q, k, v, bias, mask)
        else:
            got = jax.jit(jax.grad(lambda q, k, v, bias: loss(q, k, v, bias, mask),
                                   argnums))(q, k, v, bias)
    want = jax.grad(reference, argnums)(*(jnp.asarray(a) for a in np_args),
                                        None if bias64 is None else jnp.asarray(bias64))
    for what, g, w in zip(("dq", "dk", "dv", "dbias"), got, want, strict=False):
        assert g.dtype == q.dtype, what
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w), rtol=rtol,
                                   atol=atol, err_msg=f"{what} ({kernel}, {case}, {how})")
