"""Choosing a kernel: priority, forcing, disabling, gradients, explain, errors, logs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn._dispatch import _registry
from portattn.errors import KernelNotUsableError, NoKernelError, UnknownKernelError
from portattn.kernel import Kernel

rng = np.random.default_rng(0)
Q, K, V = (rng.standard_normal((1, 2, 8, 16)).astype(np.float32) for _ in range(3))


@pytest.fixture
def only_builtins(monkeypatch):
    """Dispatch sees the built-in kernels only (installed plugins would change choices)."""
    entries = _registry.order(_registry.builtin_entries())
    monkeypatch.setattr(_registry, "_discovered", (entries, None))
    return entries


def add_kernel(monkeypatch, cls, entries):
    entry = _registry.KernelEntry(cls.name, cls(), "portattn-test", "0.0")
    ordered = _registry.order([*entries, entry])
    monkeypatch.setattr(_registry, "_discovered", (ordered, None))
    return entry


def test_tiled_is_the_default_and_reference_returns_weights(only_builtins):
    assert portattn.explain(Q, K, V).kernel.name == "tiled"
    assert portattn.explain(Q, K, V, return_weights=True).kernel.name == "reference"


def test_forcing_by_argument_env_and_context(only_builtins, monkeypatch):
    assert portattn.explain(Q, K, V, kernel="reference").kernel.name == "reference"
    with portattn.use_kernel("reference"):
        assert portattn.explain(Q, K, V).kernel.name == "reference"
    monkeypatch.setenv("PORTATTN_KERNEL", "reference")
    assert portattn.explain(Q, K, V).kernel.name == "tiled"  # read once, with the kernels
    monkeypatch.setattr(_registry, "_discovered", None)  # as refresh_kernels() does
    assert portattn.explain(Q, K, V).kernel.name == "reference"


def test_forced_kernel_that_cannot_run(only_builtins):
    with pytest.raises(KernelNotUsableError, match="return_weights not supported") as info:
        portattn.attention(Q, K, V, return_weights=True, kernel="tiled")
    assert "kernel 'tiled' cannot run" in str(info.value)
    assert "query : shape=(1, 2, 8, 16)" in str(info.value)


def test_unknown_kernel_lists_installed_and_install_hint(only_builtins, monkeypatch):
    monkeypatch.setitem(_registry.KNOWN_PLUGINS, "fancy", "portattn-fancy")
    with pytest.raises(UnknownKernelError, match="installed kernels: reference, tiled"):
        portattn.attention(Q, K, V, kernel="nope")
    with pytest.raises(UnknownKernelError,
                       match=r"portattn-fancy: .*`pip install \./backends/portattn-fancy`"):
        portattn.attention(Q, K, V, kernel="fancy")


def test_install_hints_name_every_plugin_kernel():
    # the hints are the only list of plugin kernels not read from entry points
    from pathlib import Path

    import tomllib

    declared = {}
    for project in (Path(__file__).parents[1] / "backends").glob("*/pyproject.toml"):
        meta = tomllib.loads(project.read_text())["project"]
        for name in meta.get("entry-points", {}).get("portattn.kernels", {}):
            declared[name] = meta["name"]
    assert declared == _registry.KNOWN_PLUGINS


def test_disable_kernels_context(only_builtins):
    with portattn.disable_kernels("tiled"):
        assert portattn.explain(Q, K, V).kernel.name == "reference"
    assert portattn.explain(Q, K, V).kernel.name == "tiled"


def test_nothing_fits_lists_every_kernel(only_builtins, monkeypatch):
    from portattn._kernels import ReferenceKernel

    monkeypatch.setattr(ReferenceKernel, "dropout", False)
    with portattn.disable_kernels("tiled"), pytest.raises(NoKernelError) as info:
        portattn.attention(Q, K, V, dropout_p=0.2, dropout_seed=0)
    text = str(info.value)
    assert "no kernel can run attention with these inputs:" in text
    assert "tiled (portattn 0.1.0): disabled by portattn.disable_kernels()" in text
    assert "reference (portattn 0.1.0): dropout_p=0.2 not supported" in text
    assert "python -m portattn info" in text
    assert isinstance(info.value, NotImplementedError)


def test_priority_and_reasons_from_declared_data(only_builtins, monkeypatch):
    class Fast(Kernel):
        name = "fast"
        namespaces = frozenset({"numpy"})
        devices = frozenset({"cpu"})
        dtypes = frozenset({"float16"})
        head_dim = (32, 128)
        masks = frozenset({"causal"})
        priority = 99

        def run(self, inputs):
            raise AssertionError

    add_kernel(monkeypatch, Fast, only_builtins)
    plan = portattn.explain(Q, K, V, mask=masks.causal() & masks.sliding_window(2),
                            softcap=3.0)
    assert plan.kernel.name == "tiled"
    fast_reasons = dict((e.name, why) for e, why in plan.candidates)["fast"]
    assert fast_reasons == ("dtype=float32 (supported: float16)", "head_dim=16 < 32",
                            "value head_dim=16 < 32", "mask sliding_window not supported",
                            "softcap not supported")
    text = str(plan)
    assert text.splitlines()[0] == "kernel: tiled (portattn 0.1.0)"
    assert "fast (portattn-test 0.0): dtype=float32 (supported: float16);" in text


def test_unavailable_kernel_is_skipped(only_builtins, monkeypatch):
    from registry_kernels import Unavailable

    add_kernel(monkeypatch, Unavailable, only_builtins)
    plan = portattn.explain(Q, K, V)
    assert plan.kernel.name == "tiled"
    assert dict((e.name, why) for e, why in plan.candidates)["unavailable"] == (
        "unavailable: no such device",)


def test_gradients_go_only_to_grad_kernels(only_builtins, monkeypatch):
    torch = pytest.importorskip("torch")

    class NoGrad(Kernel):
        name = "no_grad"
        namespaces = devices = "*"
        dtypes = frozenset({"float32"})
        priority = 999

        def run(self, inputs):
            return portattn._kernels.TiledKernel().run(inputs)

    add_kernel(monkeypatch, NoGrad, only_builtins)
    q, k, v = (torch.asarray(a) for a in (Q, K, V))
    assert portattn.explain(q, k, v).kernel.name == "no_grad"
    q.requires_grad_(True)
    plan = portattn.explain(q, k, v)
    assert plan.kernel.name == "tiled"
    assert "gradients required but not supported" in str(plan)
    with torch.no_grad():
        assert portattn.explain(q, k, v).kernel.name == "no_grad"


def test_debug_log_names_kernel_and_version(only_builtins, caplog):
    with caplog.at_level(logging.DEBUG, logger="portattn"):
        portattn.attention(Q, K, V)
    assert "attention: tiled@0.1.0" in caplog.text


def run_python(code, **env):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                            capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return result.stdout


HEAVY = ("torch", "jax", "cupy", "triton", "dask", "numpy")


def test_import_portattn_imports_no_array_library():
    out = run_python(f"""
        import sys, portattn
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
    """)
    assert out.strip() == "[]"


def test_numpy_dispatch_imports_no_other_library():
    out = run_python(f"""
        import sys, numpy as np, portattn
        q = np.ones((1, 2, 4, 8), dtype=np.float32)
        print(portattn.explain(q, q, q, mask=portattn.masks.causal()))
        print(sorted(m for m in {HEAVY!r} if m in sys.modules and m != "numpy"))
    """)
    assert out.strip().splitlines()[-1] == "[]"


def test_numpy_call_imports_no_other_library():
    # torch_sdpa_dlpack (portattn-torch) exists to run NumPy calls through torch; with
    # it out of the way, NumPy calls run on NumPy alone.
    out = run_python(f"""
        import sys, numpy as np, portattn
        q = np.ones((1, 2, 4, 8), dtype=np.float32)
        portattn.attention(q, q, q, mask=portattn.masks.causal())
        print(sorted(m for m in {HEAVY!r} if m in sys.modules and m != "numpy"))
    """, PORTATTN_DISABLE_KERNELS="torch_sdpa_dlpack")
    assert out.strip() == "[]"


@pytest.mark.parametrize("options", [
    {}, {"mask": masks.causal()}, {"return_weights": True}, {"return_lse": True},
    {"kernel": "reference"}, {"mask": masks.key_lengths(np.array([3]))}])
def test_attention_and_explain_take_one_path(options):
    """explain() asks every kernel; attention() stops at the first that can run; both
    are select() and so choose the same kernel for the same call."""
    from portattn._dispatch import choose, select
    from portattn._inputs import describe

    kernel = options.pop("kernel", None)
    inputs = describe(Q, K, V, **options)
    thorough = select(inputs, kernel)
    quick = select(inputs, kernel, every=False)
    assert quick.kernel is thorough.kernel is choose(inputs, kernel)
    assert thorough.kernel is portattn.explain(Q, K, V, kernel=kernel, **options).kernel
    assert len(thorough.candidates) == len(portattn.kernels())
    # what the quick path asked, it asked the same way
    assert set(quick.candidates) <= set(thorough.candidates)


def test_explain_of_an_unknown_kernel_says_so(only_builtins):
    with pytest.raises(UnknownKernelError, match="unknown kernel 'nope'"):
        portattn.explain(Q, K, V, kernel="nope")


def test_an_unhashable_device_is_still_named():
    """CuPy's Device defines == but no hash: its kind is read all the same."""
    from portattn._lib import device_kind

    class Device:
        __hash__ = None

        def __eq__(self, other):
            return isinstance(other, Device)

        def __str__(self):
            return "<CUDA Device 0>"

    assert device_kind(Device()) == "cuda"


def test_override_blocks_in_many_threads_leave_nothing_behind(only_builtins):
    import threading

    from portattn._dispatch import _select as _dispatch

    def churn():
        for _ in range(2000):
            with portattn.use_kernel("reference"), portattn.disable_kernels("tiled"):
                assert portattn.explain(Q, K, V).kernel.name == "reference"

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    assert portattn.explain(Q, K, V).kernel.name == "tiled"  # this thread: no override
    for t in threads:
        t.join()
    assert _dispatch._open == []
    assert portattn.explain(Q, K, V).kernel.name == "tiled"


def test_an_exception_inside_an_override_block_closes_it(only_builtins):
    class Interrupt(BaseException):  # as KeyboardInterrupt is
        pass

    with pytest.raises(Interrupt), portattn.use_kernel("reference"):
        raise Interrupt
    assert portattn.explain(Q, K, V).kernel.name == "tiled"


class Picky(Kernel):
    """Computes every float32 NumPy call, but would rather leave short ones to others."""

    name = "picky"
    namespaces = frozenset({"numpy"})
    devices = frozenset({"cpu"})
    dtypes = frozenset({"float32"})
    returns_lse = True
    priority = 99
    runs = 0

    @classmethod
    def dispatch_reasons(cls, inputs):
        if inputs.q_len < 64:
            return [f"Lq={inputs.q_len} < 64 (tiled is faster on short calls)"]
        return []

    def run(self, inputs):
        type(self).runs += 1
        return portattn._kernels.TiledKernel().run(inputs)


def test_a_kernel_named_runs_what_dispatch_passes_over_for_speed(only_builtins, monkeypatch):
    add_kernel(monkeypatch, Picky, only_builtins)
    plan = portattn.explain(Q, K, V)
    assert plan.kernel.name == "tiled"
    why = dict((e.name, w) for e, w in plan.candidates)["picky"]
    assert why == ("passed over: Lq=8 < 64 (tiled is faster on short calls)",)
    assert "picky (portattn-test 0.0): passed over: Lq=8 < 64" in str(plan)
    # a preference is no reason a named kernel cannot run
    forced = portattn.explain(Q, K, V, kernel="picky")
    assert forced.kernel.name == "picky"
    before = Picky.runs
    out = portattn.attention(Q, K, V, kernel="picky")
    assert Picky.runs == before + 1
    np.testing.assert_allclose(out, portattn.attention(Q, K, V, kernel="reference"),
                               rtol=1e-5, atol=1e-6)
    with portattn.use_kernel("picky"):
        assert portattn.explain(Q, K, V).kernel.name == "picky"
    long = np.zeros((1, 2, 64, 16), np.float32)
    assert portattn.explain(long, long, long).kernel.name == "picky"


def test_a_preference_never_leaves_a_call_without_a_kernel(only_builtins, monkeypatch):
    add_kernel(monkeypatch, Picky, only_builtins)
    with portattn.disable_kernels("tiled", "reference"):
        plan = portattn.explain(Q, K, V, return_lse=True)
        assert plan.kernel.name == "picky"
        assert "passed over" in plan.note
        assert portattn.attention(Q, K, V).shape == (1, 2, 8, 16)
    with portattn.disable_kernels("tiled"):  # reference can run: it does
        assert portattn.explain(Q, K, V, return_lse=True).kernel.name == "reference"
