"""Dispatch by measurement (``portattn._dispatch._tune``): the tune file, its checks, the hook."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import ClassVar

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.__main__ import main as cli
from portattn._commands import _tune_run
from portattn._dispatch import _registry, _tune
from portattn._lib import _tuned as _settings
from portattn.kernel import Kernel
from portattn.testing.plugin import require_library


@pytest.fixture
def tune_file(tmp_path, monkeypatch):
    """A tune file path of this test's own, read afresh."""
    path = tmp_path / "tune.json"
    monkeypatch.setenv(_tune.TUNE_ENV, str(path))
    monkeypatch.setattr(_tune, "RECHECK_S", 0.0)  # see every change at once
    _tune.refresh()
    yield path
    _tune.refresh()


def _write(path, entries, *, machine=None, versions=None, created="2026-12-01T12:00:00+00:00",
           settings=None):
    contents = {"format": _tune.FORMAT, "created": created,
                "machine": _tune.machine() if machine is None else machine,
                "versions": _versions() if versions is None else versions,
                "entries": entries, **({} if settings is None else {"settings": settings})}
    path.write_text(json.dumps(contents), encoding="utf-8")


def _versions():
    """What a tune run here records: portattn and every kernel distribution."""
    return {"portattn": portattn.__version__,
            **{e.distribution: e.version for e in portattn.kernels()}}


def _row(times, *, library="numpy", dtype="float32", head_dim=64, mask="none", band="medium",
         heads=8, mode=None):
    return {"library": library, "device": "cpu", "dtype": dtype, "head_dim": head_dim,
            "mask": mask, "band": band, "times": times,
            "shape": [1, heads, _tune.BAND_SIZES[band], head_dim],
            **({} if mode is None else {"mode": mode})}


def _inputs(lq=1024, lk=None, d=64, dtype=np.float32, **kwargs):
    q = np.zeros((1, 2, lq, d), dtype)
    k = np.zeros((1, 2, lq if lk is None else lk, d), dtype)
    return portattn.explain(q, k, k, **kwargs).inputs


RUNNABLE = ("numpy_fast", "tiled", "reference")


def test_the_measured_fastest_among_the_runnable(tune_file):
    _write(tune_file, [_row({"numpy_fast": 0.02, "tiled": 0.01, "reference": 0.5})])
    name, note = _tune.measured_choice(_inputs(), RUNNABLE)
    assert name == "tiled"
    assert note == "measured fastest (tune of 2026-12-01)"


def test_a_win_within_the_noise_leaves_the_priorities(tune_file):
    # numpy_fast comes first by priority: 7% is no reason to leave it
    _write(tune_file, [_row({"numpy_fast": 0.0100, "tiled": 0.0093})])
    assert _tune.measured_choice(_inputs(), RUNNABLE) is None
    _write(tune_file, [_row({"numpy_fast": 0.0100, "tiled": 0.0080})])
    assert _tune.measured_choice(_inputs(), RUNNABLE)[0] == "tiled"


def test_calls_far_from_the_measured_shape_are_not_steered(tune_file):
    _write(tune_file, [_row({"numpy_fast": 0.02, "tiled": 0.01}, heads=8)])
    wide = _inputs()._replace(batch_shape=(16,), num_heads=16)  # 256 rows, 32x the measured
    assert _tune.measured_choice(wide, RUNNABLE) is None
    near = _inputs()._replace(batch_shape=(4,), num_heads=8)  # 32 rows: 4x
    assert _tune.measured_choice(near, RUNNABLE)[0] == "tiled"


def test_a_kernel_that_cannot_run_is_passed_over(tune_file):
    _write(tune_file, [_row({"torch_sdpa_dlpack": 0.001, "numpy_fast": 0.02, "tiled": 0.03})])
    assert _tune.measured_choice(_inputs(), RUNNABLE)[0] == "numpy_fast"
    assert _tune.measured_choice(_inputs(), ("reference",)) is None  # none of them measured


@pytest.mark.parametrize(("call", "why"), [
    ({"dtype": np.float64}, "another dtype"),
    ({"d": 128}, "another head dim band"),
    ({"lq": 4096}, "another size band"),
    ({"mask": masks.causal()}, "another mask kind"),
    ({"bias": np.zeros((1024, 1024), np.float32)}, "a bias was not measured"),
    ({"softcap": 5.0}, "a softcap was not measured"),
])
def test_only_calls_like_the_measured_one_are_steered(tune_file, call, why):
    _write(tune_file, [_row({"numpy_fast": 0.02, "tiled": 0.01})])
    assert _tune.measured_choice(_inputs(**call), RUNNABLE) is None, why


def test_bands_and_head_dims_group_nearby_calls(tune_file):
    _write(tune_file, [_row({"numpy_fast": 0.02, "tiled": 0.01}, mask="causal", band="long",
                            head_dim=64)])
    steered = _inputs(lq=3000, lk=9000, d=40, mask=masks.causal())
    assert _tune.call_key(steered)[3:] == (64, "causal", "long", "forward")
    assert _tune.measured_choice(steered, RUNNABLE)[0] == "tiled"
    assert [_tune.band(n) for n in (0, 512, 513, 2048, 2049)] == [
        "short", "short", "medium", "medium", "long"]


def test_calls_that_need_gradients_follow_the_training_calls_measured(tune_file):
    grad = _inputs()._replace(requires_grad=True)
    # a file of forward calls (written before training was timed: no mode) steers none
    _write(tune_file, [_row({"numpy_fast": 0.02, "tiled": 0.01})])
    assert _tune.measured_choice(grad, RUNNABLE) is None
    _write(tune_file, [_row({"numpy_fast": 0.02, "tiled": 0.01}, mode="forward"),
                       _row({"tiled": 0.09, "reference": 0.03}, mode="training")])
    assert _tune.measured_choice(grad, RUNNABLE)[0] == "reference"
    assert _tune.measured_choice(_inputs(), RUNNABLE)[0] == "tiled"


@pytest.mark.parametrize("library", ["torch", "jax"])
def test_training_is_timed_with_the_gradients(monkeypatch, library):
    require_library(library)
    monkeypatch.setitem(_tune.BAND_SIZES, "short", 16)
    row = _tune_run.measure(library, "float32", 8, "causal", "short", heads=2, repeats=1,
                            mode="training")
    assert row["mode"] == "training"
    assert "tiled" in row["times"]
    assert "reference" in row["times"]
    kernels = {e.name: e.kernel for e in portattn.kernels()}
    assert all(kernels[name].grad for name in row["times"])  # only kernels with gradients
    assert _tune_run.measure("numpy", "float32", 8, "causal", "short", mode="training") is None


def test_no_file_means_no_choice(tune_file):
    assert not tune_file.exists()
    assert not _tune.tuned()
    assert _tune.measured_choice(_inputs(), RUNNABLE) is None
    _write(tune_file, [_row({"tiled": 0.01})])
    assert _tune.tuned()


def test_an_empty_variable_turns_it_off(tune_file, monkeypatch):
    _write(tune_file, [_row({"tiled": 0.01})])
    monkeypatch.setenv(_tune.TUNE_ENV, "")
    assert _tune.default_path() is None
    assert _tune.measured_choice(_inputs(), RUNNABLE) is None


def test_default_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(_tune.TUNE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = _tune.default_path()
    assert path.parent == tmp_path / "portattn"
    # one file per Python environment: each virtualenv measures its own versions
    assert path.name == f"tune-{_tune.environment_id()}.json"
    other = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.prefix = '/elsewhere'; "
                            "from portattn._dispatch import _tune; print(_tune.environment_id())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert other != _tune.environment_id()


def test_a_changed_file_is_read_again(tune_file):
    _write(tune_file, [_row({"numpy_fast": 0.02, "tiled": 0.01})])
    assert _tune.measured_choice(_inputs(), RUNNABLE)[0] == "tiled"
    _write(tune_file, [_row({"numpy_fast": 0.002, "tiled": 0.01, "reference": 0.3})],
           created="2026-12-02T08:00:00+00:00")
    assert _tune.measured_choice(_inputs(), RUNNABLE) == (
        "numpy_fast", "measured fastest (tune of 2026-12-02)")


def test_the_loaded_file_is_kept_between_checks(tune_file, monkeypatch):
    _write(tune_file, [_row({"numpy_fast": 0.02, "tiled": 0.01})])
    monkeypatch.setattr(_tune, "RECHECK_S", 3600.0)
    assert _tune.measured_choice(_inputs(), RUNNABLE)[0] == "tiled"
    tune_file.unlink()
    assert _tune.measured_choice(_inputs(), RUNNABLE)[0] == "tiled"  # no look at the disk
    _tune.refresh()
    assert _tune.measured_choice(_inputs(), RUNNABLE) is None


def test_a_file_from_another_machine_is_ignored_with_a_warning(tune_file):
    elsewhere = {**_tune.machine(), "cpu": "Some Other CPU", "cpus": 1024}
    _write(tune_file, [_row({"tiled": 0.01})], machine=elsewhere)
    with pytest.warns(_tune.TuneWarning, match="another machine .*cpu='Some Other CPU'"):
        assert _tune.measured_choice(_inputs(), RUNNABLE) is None
    assert not _tune.tuned()
    assert _tune.measured_choice(_inputs(), RUNNABLE) is None  # warned once, not per call


def test_a_file_measured_with_other_cpu_kernels_is_ignored_with_a_warning(tune_file,
                                                                          monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "SkylakeX")
    _write(tune_file, [_row({"tiled": 0.01})])
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    with pytest.warns(_tune.TuneWarning, match="another machine .*OPENBLAS_CORETYPE"):
        assert _tune.measured_choice(_inputs(), RUNNABLE) is None


def test_a_machine_without_kernel_settings_matches_files_that_never_recorded_them(
        monkeypatch):
    for name in _tune.KERNEL_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    assert set(_tune.machine()) == {"system", "arch", "cpu", "cpus"}


def test_a_stale_file_is_ignored_with_a_warning(tune_file):
    _write(tune_file, [_row({"tiled": 0.01})],
           versions={"portattn": "0.0.1", "numpy": np.__version__})
    with pytest.warns(_tune.TuneWarning, match=r"stale, measured with portattn 0\.0\.1 \(now "):
        assert _tune.measured_choice(_inputs(), RUNNABLE) is None


def test_a_distribution_since_removed_makes_it_stale(tune_file):
    _write(tune_file, [_row({"tiled": 0.01})],
           versions={"portattn": portattn.__version__, "no-such-distribution-x": "1.0"})
    with pytest.warns(_tune.TuneWarning, match="no-such-distribution-x 1.0 .now not installed"):
        assert _tune.measured_choice(_inputs(), RUNNABLE) is None


def test_a_kernel_distribution_installed_since_makes_it_stale(tune_file):
    measured = _versions()
    newcomer = next(d for d in measured if d != "portattn")
    del measured[newcomer]
    _write(tune_file, [_row({"tiled": 0.01})], versions=measured)
    with pytest.warns(_tune.TuneWarning, match=f"stale, {newcomer} .* installed since"):
        assert _tune.measured_choice(_inputs(), RUNNABLE) is None


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format": 99}', '{"format": 1}'])
def test_an_unreadable_file_is_ignored_with_a_warning(tune_file, text):
    tune_file.write_text(text, encoding="utf-8")
    with pytest.warns(_tune.TuneWarning, match="not a portattn tune file"):
        assert _tune.measured_choice(_inputs(), RUNNABLE) is None


@pytest.mark.parametrize("seconds", ["fast", float("nan"), -0.01, True, None])
def test_times_that_are_not_seconds_make_the_file_unusable(tune_file, seconds):
    _write(tune_file, [_row({"numpy_fast": 0.02, "tiled": seconds})])
    with pytest.warns(_tune.TuneWarning, match=r"not a portattn tune file .*time of 'tiled'"):
        assert _tune.measured_choice(_inputs(), RUNNABLE) is None


def test_a_fifo_at_the_path_is_ignored_not_waited_on(tune_file):
    import os

    os.mkfifo(tune_file)  # reading it would block until a writer came
    with pytest.warns(_tune.TuneWarning, match="not a regular file"):
        assert _tune.measured_choice(_inputs(), RUNNABLE) is None


def test_measure_times_every_kernel_that_can_run_the_call(monkeypatch):
    monkeypatch.setitem(_tune.BAND_SIZES, "short", 16)
    row = _tune_run.measure("numpy", "float32", 8, "causal", "short", heads=2, repeats=1)
    q = np.zeros((1, 2, 16, 8), np.float32)
    plan = portattn.explain(q, q, q, mask=masks.causal())
    assert set(row["times"]) == {e.name for e, why in plan.candidates if not why}
    assert all(t > 0 for t in row["times"].values())
    assert (row["library"], row["device"], row["mask"], row["band"]) == (
        "numpy", "cpu", "causal", "short")


def test_a_missing_library_is_skipped(monkeypatch):
    monkeypatch.setitem(_tune_run.LIBRARIES, "numpy", _tune_run._Library(
        "numpy", "no_such_module_for_tune", _tune_run._numpy_make, lambda _m, out: out))
    assert _tune_run.measure("numpy", "float32", 8, "none", "short") is None


def test_the_command_writes_a_file_dispatch_reads(tune_file, monkeypatch, capsys):
    monkeypatch.setitem(_tune.BAND_SIZES, "short", 16)
    assert cli(["tune", "--libraries", "numpy", "--dtypes", "float32", "--head-dims", "8",
                "--masks", "none", "--bands", "short", "--repeats", "1"]) == 0
    assert f"wrote 1 measured calls to {tune_file}" in capsys.readouterr().out
    written = json.loads(tune_file.read_text(encoding="utf-8"))
    assert written["machine"] == _tune.machine()
    assert written["versions"]["portattn"] == portattn.__version__
    assert written["versions"]["numpy"] == np.__version__
    q = np.zeros((1, 2, 16, 8), np.float32)
    runnable = [e.name for e, why in portattn.explain(q, q, q).candidates if not why]
    times = written["entries"][0]["times"]
    assert set(runnable) <= set(times)
    # A one-repeat measurement is noise: make the last kernel clearly the fastest.
    times.update({name: 1e-3 for name in times}, **{runnable[-1]: 1e-5})
    tune_file.write_text(json.dumps(written), encoding="utf-8")
    _tune.refresh()
    assert _tune.measured_choice(portattn.explain(q, q, q).inputs, runnable)[0] == runnable[-1]


@pytest.mark.parametrize(("args", "message"), [
    (["--libraries", "cobol"], "--libraries: expected a comma-separated list of numpy, torch, "
                               "jax, dask; got 'cobol'"),
    (["--bands", "huge"], "--bands: expected a comma-separated list of short, medium, long; "
                          "got 'huge'"),
    (["--head-dims", "x"], "--head-dims: expected a comma-separated list of int; got 'x'"),
])
def test_bad_command_options_are_named(args, message, capsys):
    with pytest.raises(SystemExit):
        cli(["tune", *args])
    assert message in capsys.readouterr().err


def test_import_loads_no_array_library():
    code = ("import sys, portattn._dispatch._tune, portattn._commands._tune_run; "
            "print([m for m in ('numpy', 'torch', 'jax', 'cupy', 'dask') if m in sys.modules])")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert found == "[]"


def test_explain_names_the_measured_kernel(tune_file):
    _write(tune_file, [_row({"numpy_fast": 0.5, "tiled": 0.01}, head_dim=8, band="short")])
    q = np.zeros((1, 2, 16, 8), np.float32)
    plan = portattn.explain(q, q, q)
    assert plan.kernel.name == "tiled"
    assert "measured fastest (tune of 2026-12-01)" in str(plan)


def test_a_new_tune_file_reaches_calls_dispatch_remembered(tune_file, monkeypatch):
    """The call cache keeps decisions per call shape: a new tune file makes them stale."""
    from portattn._dispatch import _call_cache

    monkeypatch.setattr(_call_cache, "_calls", {})
    q = np.zeros((1, 2, 16, 8), np.float32)

    def kernel_run():
        portattn.attention(q, q, q)
        (remembered,) = _call_cache._calls.values()  # one call shape
        return remembered[-1].name

    first = kernel_run()
    assert kernel_run() == first
    other = "tiled" if first != "tiled" else "reference"
    _write(tune_file, [_row({first: 0.5, other: 0.01}, head_dim=8, band="short")])
    assert kernel_run() == other


class _Tunable(Kernel):
    """A kernel whose one setting decides its speed: ``spin=3`` is the fastest."""

    name = "tunable"
    namespaces = frozenset({"numpy"})
    devices = frozenset({"cpu"})
    dtypes = frozenset({"float32"})
    tunables: ClassVar[dict[str, tuple[int, ...]]] = {"spin": (1, 3, 9)}

    def run(self, inputs):
        spin = self.tuned("spin")
        time.sleep(0.001 + 0.003 * abs((1 if spin is None else spin) - 3))
        out = np.full((*inputs.batch_shape, inputs.num_heads, inputs.q_len,
                       inputs.value_head_dim), -1.0 if spin is None else spin, np.float32)
        return out, None, None


@pytest.fixture
def tunable(monkeypatch):
    entries = _registry.kernel_entries()
    entry = _registry.KernelEntry(_Tunable.name, _Tunable(), "portattn-test", "0.0")
    monkeypatch.setattr(_registry, "_discovered", (_registry.order([*entries, entry]), None))
    installed = _tune.installed_version  # as if its distribution were installed
    monkeypatch.setattr(_tune, "installed_version",
                        lambda dist: "0.0" if dist == "portattn-test" else installed(dist))
    return _Tunable


def test_tune_times_each_value_of_a_tunable_and_the_kernel_reads_the_fastest(
        tune_file, tunable, monkeypatch, capsys):
    monkeypatch.setitem(_tune.BAND_SIZES, "short", 16)
    q = np.zeros((1, 2, 16, 8), np.float32)
    assert tunable.tuned("spin") is None  # no tune file: the kernel's default
    assert float(portattn.attention(q, q, q, kernel="tunable")[0, 0, 0, 0]) == -1.0
    assert cli(["tune", "--libraries", "numpy", "--dtypes", "float32", "--head-dims", "8",
                "--masks", "none", "--bands", "short", "--repeats", "3"]) == 0
    assert "tunable spin: 3 (time over the best, per value: 1 " in capsys.readouterr().out
    found = json.loads(tune_file.read_text(encoding="utf-8"))["settings"]["tunable"]["spin"]
    assert found["chosen"] == 3
    assert set(found["ratios"]) == {"1", "3", "9"}
    # one call timed: the fastest value's ratio is 1 exactly. Between the two slower
    # ones no order is asserted: 9 keeps its one warm-up time (over HOPELESS times the
    # best), and on a busy machine a 7 ms sleep of 1 has been measured longer than that
    assert found["ratios"]["3"] == 1.0 < min(found["ratios"]["1"], found["ratios"]["9"])
    assert tunable.tuned("spin") == 3
    assert float(portattn.attention(q, q, q, kernel="tunable")[0, 0, 0, 0]) == 3.0
    assert cli(["info"]) == 0
    shown = next(line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("tunable ") and "spin" in line)
    assert shown.split() == ["tunable", "spin", "1,3,9", "3"]


def test_a_tuned_setting_is_read_only_from_a_usable_file(tune_file, tunable):
    settings = {"tunable": {"spin": {"chosen": 9, "ratios": {}}}}
    _write(tune_file, [], settings=settings)
    assert tunable.tuned("spin") == 9
    assert tunable.tuned("other") is None
    _write(tune_file, [], settings=settings, machine={"cpu": "elsewhere"})
    with pytest.warns(_tune.TuneWarning, match="another machine"):
        assert tunable.tuned("spin") is None
    with _settings.trying("tunable", "spin", 1):  # how tune times each value
        assert tunable.tuned("spin") == 1
