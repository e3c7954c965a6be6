"""The entry-point pipeline, with hand-made entry points (no packaging needed)."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from portattn._dispatch import _registry as registry
from portattn.errors import PluginWarning

GROUP = registry.GROUP


def ep(name, value):
    return EntryPoint(name, value, GROUP)


def names(entries):
    return [e.name for e in entries]


def test_builtins_always_present_and_ordered():
    entries = registry.discover(eps=[], disabled=frozenset())
    assert names(entries) == ["tiled", "reference"]
    assert {e.distribution for e in entries} == {"portattn"}


def test_plugins_ordered_by_priority_then_name():
    entries = registry.discover(eps=[ep("good", "registry_kernels:Good"),
                                     ep("urgent", "registry_kernels:Urgent")],
                                disabled=frozenset())
    assert names(entries) == ["urgent", "tiled", "good", "reference"]


def test_import_failure_is_a_warning_and_an_unavailable_entry():
    with pytest.warns(PluginWarning, match=r"'broken' from unknown \?.*ModuleNotFoundError"):
        entries = registry.discover(eps=[ep("broken", "no_such_module_xyz:K")],
                                    disabled=frozenset())
    broken = next(e for e in entries if e.name == "broken")
    assert broken.kernel is None
    assert broken.status.startswith("unavailable: failed to import no_such_module_xyz:K")


@pytest.mark.parametrize(("value", "words"), [
    ("registry_kernels:NOT_A_KERNEL", "not a portattn.kernel.Kernel subclass"),
    ("registry_kernels:Misnamed", "declares name='something_else'"),
])
def test_invalid_plugins_are_rejected(value, words):
    with pytest.warns(PluginWarning, match=words):
        entry = registry.load(ep("good", value))
    assert entry.kernel is None
    assert words in entry.status


def test_disabled_plugins_are_not_imported():
    entries = registry.discover(eps=[ep("broken", "no_such_module_xyz:K")],
                                disabled=frozenset({"broken", "tiled"}))
    status = {e.name: e.status for e in entries}
    assert status["broken"] == "disabled by PORTATTN_DISABLE_KERNELS"
    assert status["tiled"] == "disabled by PORTATTN_DISABLE_KERNELS"
    assert status["reference"] is None


def test_duplicates_resolved_by_stated_rule():
    low = registry.KernelEntry("good", registry.load(ep("good", "registry_kernels:Good")).kernel,
                               "portattn-b", "1.0")
    high = registry.KernelEntry("good", low.kernel, "portattn-a", "2.0")
    with pytest.warns(PluginWarning, match="provided by both portattn-a 2.0 and portattn-b 1.0"):
        kept = registry.resolve_duplicates([low, high])
    assert [e.distribution for e in kept] == ["portattn-a"]


def test_core_wins_a_name_clash():
    builtin = registry.builtin_entries()[1]  # tiled
    impostor = registry.KernelEntry("tiled", builtin.kernel, "portattn-evil", "9.9")
    with pytest.warns(PluginWarning, match="using portattn 0.1.0"):
        kept = registry.resolve_duplicates([impostor, builtin])
    assert kept[0].distribution == "portattn"


def test_discovery_is_cached_and_refreshable(monkeypatch):
    calls = []
    real = registry.discover
    monkeypatch.setattr(registry, "discover", lambda **kw: calls.append(1) or real(**kw))
    monkeypatch.setattr(registry, "_discovered", None)
    registry.kernels()
    registry.kernels()
    assert len(calls) == 1
    registry.refresh_kernels()
    assert len(calls) == 2


def test_disable_env_is_read_on_discovery_and_refresh(monkeypatch):
    monkeypatch.setattr(registry, "_discovered", None)  # restored after the test
    monkeypatch.setenv(registry.DISABLE_ENV, "tiled")
    tiled = next(e for e in registry.kernels() if e.name == "tiled")
    assert tiled.kernel is None
    monkeypatch.delenv(registry.DISABLE_ENV)
    assert next(e for e in registry.kernels() if e.name == "tiled").kernel is None
    assert next(e for e in registry.refresh_kernels() if e.name == "tiled").kernel is not None


def test_availability_is_cached_per_class():
    from registry_kernels import Unavailable

    assert Unavailable.available() == "no such device"
    assert "_availability" in Unavailable.__dict__
