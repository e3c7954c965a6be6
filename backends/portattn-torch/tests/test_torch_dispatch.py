"""Which kernel dispatch picks for torch tensors, availability, and lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from portattn.testing.plugin import require_library

torch = require_library("torch")

from portattn_torch import TorchSDPADLPackKernel, TorchSDPAKernel, _availability  # noqa: E402

import portattn  # noqa: E402
from portattn import masks  # noqa: E402


def _qkv(hq=4, hkv=4, lq=8, lk=8, d=16, dv=16, dtype=torch.float32):
    return (torch.randn(2, hq, lq, d, dtype=dtype), torch.randn(2, hkv, lk, d, dtype=dtype),
            torch.randn(2, hkv, lk, dv, dtype=dtype))


HONOURED = {
    "plain": {},
    "causal": {"mask": masks.causal()},
    "window": {"mask": masks.sliding_window(3, 1)},
    "lengths": {"mask": masks.key_lengths(torch.tensor([3, 8]))
                & masks.query_lengths(torch.tensor([8, 2]))},
    "dense_and_bias": {"mask": masks.dense(torch.ones(8, 8, dtype=torch.bool)),
                       "bias": torch.zeros(8, 8)},
    "dropout": {"dropout_p": 0.1},
}


@pytest.mark.parametrize("name", sorted(HONOURED))
@pytest.mark.parametrize("shape", [{}, {"hq": 8, "hkv": 2, "dv": 24}],
                         ids=["mha", "gqa_dv"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_torch_tensors_run_torch_sdpa(name, shape, dtype):
    q, k, v = _qkv(**shape, dtype=getattr(torch, dtype))
    plan = portattn.explain(q, k, v, **HONOURED[name])
    assert plan.kernel.name == "torch_sdpa", str(plan)


FALLBACKS = {
    "softcap": ({"softcap": 30.0}, "tiled", "softcap not supported"),
    "lse": ({"return_lse": True}, "tiled", "return_lse not supported"),
    "weights": ({"return_weights": True}, "reference", "return_weights not supported"),
}


@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_what_sdpa_cannot_do_falls_back(name):
    kwargs, fallback, reason = FALLBACKS[name]
    q, k, v = _qkv()
    plan = portattn.explain(q, k, v, **kwargs)
    assert plan.kernel.name == fallback
    why = dict((e.name, r) for e, r in plan.candidates)["torch_sdpa"]
    assert reason in why
    assert reason in str(plan)
    # and the call itself runs (on the fallback) instead of failing
    got = portattn.attention(q, k, v, **kwargs)
    want = portattn.attention(q, k, v, kernel="reference", **kwargs)
    for a, b in zip(*((x,) if torch.is_tensor(x) else x for x in (got, want)), strict=True):
        torch.testing.assert_close(a, b)


def test_numpy_arrays_are_borrowed_but_stay_below_native_kernels():
    np = require_library("numpy")
    q = np.zeros((1, 2, 4, 8), dtype=np.float32)
    plan = portattn.explain(q, q, q)
    order = [e.name for e, _ in plan.candidates]
    assert order.index("torch_sdpa_dlpack") < order.index("tiled")
    assert TorchSDPADLPackKernel.priority < 50 < TorchSDPAKernel.priority
    assert TorchSDPADLPackKernel.priority > 10
    with portattn.disable_kernels("numpy_fast"):
        assert portattn.explain(q, q, q).kernel.name == "torch_sdpa_dlpack"


def test_availability_without_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(_availability.importlib.util, "find_spec", lambda name: None)
    assert _availability.torch_unavailable() == "torch is not installed"


def test_availability_with_old_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.3.1+cpu")
    assert _availability.torch_unavailable() == "torch 2.3 is too old (needs >= 2.5)"


def test_available_here():
    assert TorchSDPAKernel.available() is None
    assert TorchSDPADLPackKernel.available() is None


def test_no_torch_import_for_numpy_dispatch():
    # Dispatch asks these kernels about every NumPy call; answering must not import torch.
    code = (
        "import sys, numpy as np\n"
        "from portattn.kernel import describe\n"
        "from portattn_torch import TorchSDPADLPackKernel, TorchSDPAKernel\n"
        "q = np.zeros((1, 2, 4, 8))\n"
        "inputs = describe(q, q, q, softcap=2.0)\n"
        "for kernel in (TorchSDPAKernel, TorchSDPADLPackKernel):\n"
        "    assert kernel.available() is None\n"
        "    assert kernel.not_supported_reasons(inputs)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)
