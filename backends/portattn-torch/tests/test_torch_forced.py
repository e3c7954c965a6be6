"""``kernel="name"`` runs every call the kernel computes exactly. What dispatch leaves to
other kernels for speed or memory (a kernel's ``dispatch_reasons``) is a preference
that ``explain()`` shows as "passed over: ...", never a refusal of a kernel named."""

from __future__ import annotations

import numpy as np
import pytest

from portattn.testing import assert_close, oracle
from portattn.testing.plugin import require_library

torch = require_library("torch")

import portattn  # noqa: E402
from portattn import masks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# name: (length, grad, mask): a call the kernel computes and dispatch leaves to another
CALLS = {
    # fewer scores than compiled flex pays for on a CPU
    "torch_flex": (48, False, lambda: masks.causal() & masks.sliding_window(8)),
    # gradients through a window SDPA would take as a dense mask
    "torch_sdpa": (600, True, lambda: masks.sliding_window(32)),
    # no documents: torch_sdpa runs it as one segment per batch element
    "torch_sdpa_segments": (40, False, lambda: masks.causal()),
    # a window without global tokens
    "torch_sdpa_local": (40, False, lambda: masks.sliding_window(6)),
}


def _qkv(length, grad):
    g = torch.Generator().manual_seed(length)
    return tuple(torch.randn(2, 2, length, 16, generator=g, requires_grad=grad)
                 for _ in range(3))


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_kernel_named_runs_the_calls_dispatch_passes_over(name):
    length, grad, mask = CALLS[name]
    q, k, v = _qkv(length, grad)
    plan = portattn.explain(q, k, v, mask=mask())
    assert plan.kernel.name != name, str(plan)
    why = dict((e.name, w) for e, w in plan.candidates)[name]
    assert why
    assert all(w.startswith("passed over: ") for w in why), why
    assert portattn.explain(q, k, v, mask=mask(), kernel=name).kernel.name == name
    got = portattn.attention(q, k, v, mask=mask(), kernel=name)
    want = portattn.attention(*(x.double() for x in (q, k, v)), mask=mask(),
                              kernel="reference")
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    if grad:
        (got_grad,) = torch.autograd.grad(got.sum(), q)
        (want_grad,) = torch.autograd.grad(want.sum(), q)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length", [40, 120])
def test_flex_never_runs_float32_lengths_its_cpu_template_gets_wrong(length):
    # torch's compiled CPU flex_attention read past the end at lengths 8 past a
    # multiple of 16; a large enough call reached it through dispatch
    rng = np.random.default_rng(5)
    q = torch.tensor(rng.standard_normal((16, 16, length, 16)), dtype=torch.float32)
    mask = masks.causal() & masks.sink_tokens(4)
    plan = portattn.explain(q, q, q, mask=mask, kernel="torch_flex")
    assert plan.kernel is None
    reasons = dict((entry.name, why) for entry, why in plan.candidates)["torch_flex"]
    assert any(f"Lq={length} on cpu in float32" in r for r in reasons), reasons
    assert_close(portattn.attention(q, q, q, mask=mask), oracle(q, q, q, mask=mask)[0],
                 "float32")
