"""The first call of a process made inside ``torch.compile(fullgraph=True)``: the mask
built there and every torch kernel's availability asked there for the first time,
with nothing traced that dynamo cannot (a fresh interpreter, so no earlier test has
answered those questions already)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

_FIRST_CALL = """
import torch
import portattn
from portattn import masks

portattn.kernels()  # discovery reads entry points: before compiling, as documented


@torch.compile(fullgraph=True, backend="eager")
def step(q, k, v, lengths):
    mask = masks.causal() & masks.key_lengths(lengths)
    return portattn.attention(q, k, v, mask=mask)


q, k, v = (torch.randn(2, 4, 32, 16) for _ in range(3))
lengths = torch.tensor([32, 20])
out = step(q, k, v, lengths)
want = portattn.attention(q, k, v, mask=masks.causal() & masks.key_lengths(lengths),
                          kernel="reference")
torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
print("ok")
"""


def test_a_mask_built_and_kernels_first_asked_while_compiling():
    run = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


# dynamo warns about array-api-compat's lru_caches
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_compiling_after_calls_on_numpy_arrays():
    """Calls remembered for other libraries (keys holding NumPy dtypes, which dynamo
    cannot compare) do not stop a compiled call."""
    import numpy as np
    import torch

    import portattn
    from portattn import masks

    a = np.zeros((1, 2, 8, 16), np.float32)
    portattn.attention(a, a, a, mask=masks.causal())
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    step = torch.compile(lambda q, k, v: portattn.attention(q, k, v, mask=masks.causal(),
                                                            kernel="torch_sdpa"),
                         fullgraph=True, backend="eager")
    want = portattn.attention(q, k, v, mask=masks.causal(), kernel="reference")
    torch.testing.assert_close(step(q, k, v), want, rtol=2e-5, atol=2e-5)


_PORTABLE_KERNEL = """
import sys

import torch
import portattn
from portattn import masks

portattn.kernels()
built_before = sys.argv[1] == "eager first"


def loss(q, k, v):
    mask = masks.causal() & masks.sliding_window(8)
    return portattn.attention(q, k, v, mask=mask, kernel="tiled").sin().sum()


q, k, v = (torch.randn(2, 2, 40, 16, requires_grad=True) for _ in range(3))
if built_before:
    loss(q, k, v)
step = torch.compile(loss, fullgraph=True, backend="eager")
got = torch.autograd.grad(step(q, k, v), (q, k, v))
mask = masks.causal() & masks.sliding_window(8)
want = torch.autograd.grad(
    portattn.attention(q, k, v, mask=mask, kernel="reference").sin().sum(), (q, k, v))
for g, w in zip(got, want):
    torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)
print("ok")
"""


@pytest.mark.parametrize("order", ["compiled first", "eager first"])
def test_tiled_forward_and_backward_while_compiling(order):
    """tiled skips tiles by a block form built with NumPy, which dynamo cannot trace:
    compiled, it takes the form an eager call built, or visits every tile."""
    run = subprocess.run([sys.executable, "-c", _PORTABLE_KERNEL, order],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


_FLEX = """
import torch
import portattn
from portattn import masks

from portattn_torch._flex_kernel import _check_device

portattn.kernels()
if (why := _check_device("cpu")) is not None:  # leaves the check to the calls
    raise SystemExit(f"skip: {why}")
q, k, v = (torch.randn(1, 2, 1024, 16) for _ in range(3))


def call(q, k, v, kernel=None):
    return portattn.attention(q, k, v, mask=masks.causal() & masks.sliding_window(64),
                              kernel=kernel)


want = call(q, k, v, "reference")
# flex's device check was not run yet: a traced call goes to another kernel
torch.testing.assert_close(torch.compile(call, fullgraph=True)(q, k, v), want,
                           rtol=2e-5, atol=2e-5)
eager = call(q, k, v, "torch_flex")  # checks the device
forced = torch.compile(lambda q, k, v: call(q, k, v, "torch_flex"), fullgraph=True)
torch.testing.assert_close(forced(q, k, v), want, rtol=2e-5, atol=2e-5)
print("ok")
"""


def test_torch_flex_while_compiling_after_its_device_was_checked():
    """flex's device check cannot be traced: asked first while tracing, flex declines
    the call with that reason; once an eager call checked it, a traced call runs."""
    run = subprocess.run([sys.executable, "-c", _FLEX], capture_output=True, text=True,
                         timeout=600)
    if "skip: " in run.stderr:
        pytest.skip(run.stderr.split("skip: ")[-1].strip())
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


def test_discovery_loads_what_the_plugin_registers_for_torch(monkeypatch):
    """What a traced call would otherwise look up in entry points, which dynamo cannot
    trace: the autograd wiring, the dropout seeds and the distributed engine."""
    import torch  # noqa: F401  (imported: its plugin's parts load with the kernels)

    import portattn
    from portattn._lib import _plugins

    monkeypatch.setattr(_plugins, "_parts", {})
    portattn.refresh_kernels()
    parts = _plugins._parts["torch"]  # looked up by discovery, not by the call
    assert parts.attach_autograd is not None
    assert parts.seeds is not None
    assert parts.distributed is not None
