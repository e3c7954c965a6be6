"""Dispatch by evidence: the measurements plugins ship decide between kernels that can
run a call, over priorities and deferrals; explain() names them; bad files are
ignored with a warning."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn._dispatch import _evidence, _registry, select
from portattn._dispatch._tune import TuneWarning
from portattn._inputs import describe
from portattn._lib import device_class

PLUGIN = '''
from portattn._kernels import TiledKernel


class Fused(TiledKernel):
    name = "fused"
    devices = frozenset({"cpu", "cuda"})
    priority = 300

    @classmethod
    def defers_to(cls, inputs):
        return ("native",)


class Native(TiledKernel):
    name = "native"
    devices = frozenset({"cpu", "cuda"})
    priority = 250
'''


def entry(device, seconds, mask="causal", mode="forward", shape=(1, 2, 2, 4096, 4096, 64)):
    return {"device": device, "dtype": "float32", "shape": list(shape), "mask": mask,
            "mode": mode, "seconds": seconds,
            "measured": {"gpu": "Test GPU", "date": "2026-12-01"}}


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Two kernels in a package of their own (``fused`` defers to ``native``); write
    ``evidence.json`` into the returned folder to ship evidence with them."""
    package = tmp_path / "evidence_plugin"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evidence_plugin", raising=False)
    import evidence_plugin

    entries = [_registry.KernelEntry(cls.name, cls(), "evidence-plugin", "0.1")
               for cls in (evidence_plugin.Fused, evidence_plugin.Native)]
    ordered = _registry.order([*_registry.builtin_entries(), *entries])
    monkeypatch.setattr(_registry, "_discovered", (ordered, None))
    monkeypatch.setattr(_evidence, "_loaded", {"packages": None, "table": {}})
    return package


def ship(package, *entries):
    (package / "evidence.json").write_text(json.dumps({"format": 1, "entries": entries}))
    _evidence._loaded["packages"] = None


def causal_call(length=4096):
    q = np.zeros((1, 2, length, 64), np.float32)
    return q, q, q


def test_without_evidence_a_kernel_defers_to_the_one_it_names(plugin):
    plan = portattn.explain(*causal_call(), mask=masks.causal())
    assert plan.kernel.name == "native"
    why = dict((e.name, w) for e, w in plan.candidates)["fused"]
    assert why == ("passed over: defers to native, which can run the call, unless "
                   "measured faster",)
    assert plan.note is None
    # the deferral holds only for a kernel that can run the call
    with portattn.disable_kernels("native"):
        assert portattn.explain(*causal_call(), mask=masks.causal()).kernel.name == "fused"
    # and a named kernel runs without being asked
    assert portattn.explain(*causal_call(), kernel="fused").kernel.name == "fused"


def test_evidence_wins_over_the_deferral_and_explain_names_it(plugin):
    ship(plugin, entry("cpu", {"fused": 1.0, "native": 1.5}))
    plan = portattn.explain(*causal_call(), mask=masks.causal())
    assert plan.kernel.name == "fused"
    assert plan.note == ("measured on Test GPU, 2026-12-01: fused 1.50x faster than native "
                         "for float32, causal, forward, prefill, head dim 64, long "
                         "sequences (`python -m portattn tune` measures this machine)")
    assert f"chosen ({plan.note})" in str(plan)
    out = portattn.attention(*causal_call(512), mask=masks.causal())  # another size band:
    assert out.shape == (1, 2, 512, 64)                                # no evidence there
    assert portattn.explain(*causal_call(512), mask=masks.causal()).kernel.name == "native"


def test_evidence_that_confirms_the_rules_is_named_too(plugin):
    ship(plugin, entry("cpu", {"fused": 1.0, "native": 0.4}))
    plan = portattn.explain(*causal_call(), mask=masks.causal())
    assert plan.kernel.name == "native"
    assert "native 2.50x faster than fused" in plan.note


def test_a_win_within_the_margin_keeps_the_rules_choice(plugin):
    ship(plugin, entry("cpu", {"fused": 0.99, "native": 1.0}))
    plan = portattn.explain(*causal_call(), mask=masks.causal())
    assert plan.kernel.name == "native"
    assert "native within 2% of fused" in plan.note


def test_evidence_is_by_class_of_call(plugin):
    ship(plugin, entry("cpu", {"fused": 1.0, "native": 2.0}, mode="training"),
         entry("cpu", {"fused": 1.0, "native": 2.0}, mask="none"),
         entry("cuda sm_90", {"fused": 1.0, "native": 2.0}))
    assert portattn.explain(*causal_call(), mask=masks.causal()).kernel.name == "native"
    assert portattn.explain(*causal_call()).kernel.name == "fused"


def test_entries_of_one_class_add_up(plugin):
    ship(plugin, entry("cpu", {"fused": 1.0, "native": 3.0}),
         entry("cpu", {"fused": 4.0, "native": 1.0}, shape=(4, 8, 8, 3000, 3000, 40)))
    plan = portattn.explain(*causal_call(), mask=masks.causal())
    assert plan.kernel.name == "native"
    assert "native 1.25x faster than fused" in plan.note


class FakeGpu:
    """A GPU device as CuPy and JAX give it: a compute capability, no hash."""

    compute_capability = "90"

    def __eq__(self, other):
        return isinstance(other, FakeGpu)

    __hash__ = None

    def __str__(self):
        return "cuda:0"


def test_device_class_names_the_generation():
    assert device_class(FakeGpu()) == "cuda sm_90"
    assert device_class("cpu") == "cpu"


def test_explain_on_a_gpu_call_names_the_evidence_for_its_device(plugin):
    ship(plugin, entry("cuda sm_90", {"fused": 1.0, "native": 2.4}, mode="training"),
         entry("cuda sm_80", {"fused": 3.0, "native": 1.0}, mode="training"))
    inputs = describe(*causal_call(), mask=masks.causal())
    gpu = inputs._replace(device="cuda", device_obj=FakeGpu(), requires_grad=True)
    plan = select(gpu)
    assert plan.kernel.name == "fused"
    assert plan.note.startswith("measured on Test GPU, 2026-12-01: fused 2.40x faster "
                                "than native for float32, causal, training")


@pytest.mark.parametrize(("contents", "says"), [
    ({"format": 2, "entries": []}, "format=2"),
    ({"format": 1, "entries": [{"device": "cpu"}]}, "an entry has no dtype, shape, mask"),
    ({"format": 1, "entries": [entry("cpu", {"fused": -1.0, "native": 1.0})]},
     "seconds of 'fused' is -1.0"),
    ({"format": 1, "entries": [entry("cpu", {"fused": float("nan"), "native": 1.0})]},
     "seconds of 'fused' is nan"),
])
def test_a_bad_evidence_file_is_ignored_with_a_warning(plugin, contents, says):
    (plugin / "evidence.json").write_text(json.dumps(contents))
    with pytest.warns(TuneWarning, match="ignoring the evidence evidence_plugin ships"):
        plan = portattn.explain(*causal_call(), mask=masks.causal())
    assert plan.kernel.name == "native"
    with pytest.raises(ValueError, match=says):
        _evidence.parse(contents, "x")
