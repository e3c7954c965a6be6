"""What dispatch trusts of a third-party kernel, and what it checks.

A kernel's declarations decide where it runs; dispatch does not run values through it
ahead of time (the conformance kit is how a plugin proves its numbers). What dispatch
does check on every call costs no data reads: availability checks that raise make the
kernel unavailable (with a warning), and the shape and dtype of every result are
compared with the call's.
"""

from __future__ import annotations

import numpy as np
import pytest
import registry_kernels as rk

import portattn
from portattn.__main__ import main
from portattn._dispatch import _registry as registry
from portattn.errors import KernelOutputError, PluginWarning


@pytest.fixture
def installed(monkeypatch):
    """Replace the installed kernels with the built-ins plus the given classes."""
    def install(*classes):
        for cls in classes:
            if "_availability" in cls.__dict__:
                delattr(cls, "_availability")
        entries = registry.builtin_entries() + [
            registry.KernelEntry(c.name, c(), "third-party", "1.0") for c in classes]
        monkeypatch.setattr(registry, "_discovered", (registry.order(entries), None))
    return install


def _qkv():
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(3))


def test_raising_availability_check_is_unavailable_with_a_warning(installed):
    installed(rk.RaisingAvailability)
    with pytest.warns(PluginWarning, match="raising_availability.*driver exploded"):
        out = portattn.attention(*_qkv())
    assert out.shape == (1, 2, 5, 8)
    plan = portattn.explain(*_qkv())
    assert plan.kernel.name != "raising_availability"
    why = dict((e.name, w) for e, w in plan.candidates)["raising_availability"]
    assert why == ("unavailable: check_available raised RuntimeError: driver exploded",)


def test_info_survives_a_raising_availability_check(installed, capsys):
    installed(rk.RaisingAvailability)
    with pytest.warns(PluginWarning):
        assert main(["info"]) == 0
    assert "unavailable: check_available raised RuntimeError" in capsys.readouterr().out


def test_a_result_of_the_wrong_shape_is_an_error_naming_the_kernel(installed):
    installed(rk.WrongShape)
    with pytest.raises(KernelOutputError, match=r"wrong_shape \(third-party 1.0\).*"
                       r"out.shape=\(1, 2, 4, 8\), expected \(1, 2, 5, 8\)"):
        portattn.attention(*_qkv())


def test_a_raising_refusal_is_a_reason_not_a_failure_of_every_call(installed):
    installed(rk.RaisingReasons)
    out = portattn.attention(*_qkv())
    assert out.shape == (1, 2, 5, 8)
    why = dict((e.name, w) for e, w in portattn.explain(*_qkv()).candidates)
    assert why["raising_reasons"] == ("not_supported_reasons raised KeyError: 'bad declaration'",)


def test_an_error_inside_a_kernel_names_the_kernel(installed):
    installed(rk.RaisingRun)
    with pytest.raises(RuntimeError, match="out of registers") as raised:
        portattn.attention(*_qkv())
    notes = getattr(raised.value, "__notes__", ["raised by kernel raising_run (third-party 1.0)"])
    assert notes == ["raised by kernel raising_run (third-party 1.0)"]


def test_a_plugin_that_exits_at_import_leaves_the_caller_running():
    from importlib.metadata import EntryPoint

    with pytest.warns(PluginWarning, match=r"'exiting'.*SystemExit: no GPU here"):
        entries = registry.discover(eps=[EntryPoint("exiting", "exiting_plugin:K", registry.GROUP)],
                                    disabled=frozenset())
    assert next(e for e in entries if e.name == "exiting").kernel is None


def test_calls_run_while_torch_is_half_imported(monkeypatch):
    # Another thread importing torch: the module exists before its attributes do.
    import types

    monkeypatch.setitem(__import__("sys").modules, "torch", types.ModuleType("torch"))
    out = portattn.attention(*_qkv(), mask=portattn.masks.key_lengths(np.array([3])))
    assert out.shape == (1, 2, 5, 8)


def test_explain_shows_what_the_chosen_kernel_notes(installed):
    installed(rk.Compiling)
    plan = portattn.explain(*_qkv())
    assert plan.kernel_notes == ("compiles a kernel for Lq=5 on first use",)
    assert str(plan).endswith("\nnote: compiles a kernel for Lq=5 on first use")
    installed(rk.RaisingNotes)
    plan = portattn.explain(*_qkv())
    assert plan.kernel_notes == ("raising_notes.notes raised RuntimeError: no notes today",)
