"""The one backend-selection rule of portattn.testing: selected and missing fails,
unselected skips, with no selection a missing backend skips."""

from __future__ import annotations

import itertools
import sys
import types

import pytest

from portattn.testing import plugin


def _missing(name):
    msg = f"no {name} here"
    raise ImportError(msg)


@pytest.fixture
def missing(monkeypatch):
    """Every backend fails to load."""
    monkeypatch.setattr(plugin, "get_backend", _missing)


@pytest.mark.usefixtures("missing")
def test_a_selected_missing_backend_fails(monkeypatch):
    monkeypatch.setenv(plugin.ENV, "numpy,torch")
    with pytest.raises(pytest.fail.Exception, match=r"backend torch is selected .* no torch"):
        plugin.require_backend("torch")


@pytest.mark.usefixtures("missing")
def test_a_missing_backend_skips_without_a_selection(monkeypatch):
    monkeypatch.delenv(plugin.ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"backend torch not available"):
        plugin.require_backend("torch")


def test_an_unselected_backend_skips(monkeypatch):
    monkeypatch.setenv(plugin.ENV, "numpy")
    with pytest.raises(pytest.skip.Exception, match=r"backend jax is not selected"):
        plugin.require_backend("jax")


def test_a_library_a_selected_backend_needs_must_import(monkeypatch):
    monkeypatch.setenv(plugin.ENV, "dask")
    with pytest.raises(pytest.fail.Exception, match=r"backend dask needs it"):
        plugin.require_library("portattn_no_such_module", backend="dask")
    monkeypatch.setenv(plugin.ENV, "numpy")
    with pytest.raises(pytest.skip.Exception, match=r"not installed"):
        plugin.require_library("portattn_no_such_module", backend="dask")


def test_a_library_maps_to_its_backends(monkeypatch):
    monkeypatch.setenv(plugin.ENV, "torch_cuda")
    with pytest.raises(pytest.fail.Exception, match=r"backend torch_cuda needs it"):
        plugin.require_library("torch.no_such_submodule")


def test_unknown_names_are_a_usage_error(monkeypatch):
    monkeypatch.setenv(plugin.ENV, "numpy,nupmy")
    with pytest.raises(pytest.UsageError, match=r"unknown backends \['nupmy'\]"):
        plugin.selected_backends()


def test_the_fixture_runs_on_each_selected_backend(backend, request):
    assert request.node.callspec.id == backend.name


def test_the_suite_drops_jax_programs_near_the_mapping_limit(monkeypatch):
    """XLA's compiled CPU programs each map code pages; past half the kernel's limit the
    suite drops them, checking once every ``_MAPPINGS_CHECK_EVERY`` tests."""
    cleared = []
    monkeypatch.setitem(sys.modules, "jax",
                        types.SimpleNamespace(clear_caches=lambda: cleared.append(1)))
    monkeypatch.setattr(plugin, "_finished_tests", itertools.count(1))
    monkeypatch.setattr(plugin, "_process_mappings", lambda: (30_000, 65_530))
    for _ in range(2 * plugin._MAPPINGS_CHECK_EVERY):
        plugin.pytest_runtest_teardown(None)
    assert cleared == []
    monkeypatch.setattr(plugin, "_process_mappings", lambda: (40_000, 65_530))
    for _ in range(2 * plugin._MAPPINGS_CHECK_EVERY):
        plugin.pytest_runtest_teardown(None)
    assert cleared == [1, 1]


def test_the_mapping_count_reads_this_process():
    mappings = plugin._process_mappings()
    if mappings is None:
        pytest.skip("no /proc here")
    in_use, limit = mappings
    assert 0 < in_use < limit
