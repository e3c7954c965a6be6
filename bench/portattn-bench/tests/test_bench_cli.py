"""``portattn-bench`` end to end on a tiny NumPy sweep, and the pieces it is built from."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from portattn_bench import main
from portattn_bench.cases import Shape, SweepConfig, attention_flops, causal_pairs, flops
from portattn_bench.machine import summary
from portattn_bench.measure import MAX_SAMPLES, measure
from portattn_bench.report import SCHEMA
from portattn_bench.runners import side

RUNNERS = ("reference", "tiled", "numpy_textbook", "numpy_sgemm")
SIZES = (16, 32)
TINY = ["--backends", "numpy", "--kernels", ",".join(RUNNERS), "--sizes",
        ",".join(map(str, SIZES)), "--heads", "2", "--head-dim", "8", "--repeat", "2",
        "--no-progress"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One tiny sweep shared by the tests that read its outputs (capsys is per test)."""
    out = tmp_path_factory.mktemp("bench")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([*TINY, "--out", str(out)])
    return {"code": code, "out": out, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
            "json": json.loads((out / "portattn-bench-cpu.json").read_text())}


def test_exit_code(run: dict) -> None:
    assert run["code"] == 0, run["stderr"]


def test_json_schema(run: dict) -> None:
    data = run["json"]
    assert data["schema"] == SCHEMA
    for key in ("cpu", "cpu_count", "python", "blas", "versions"):
        assert key in data["machine"]
    assert {"portattn", "numpy"} <= set(data["machine"]["versions"])
    assert data["config"]["sizes"] == list(SIZES)
    rows = data["results"]
    seen = {(r["runner"], r["q_len"], r["mask"]) for r in rows}
    assert seen == {(n, length, m) for n in RUNNERS for length in SIZES
                    for m in ("none", "causal")}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["backend"] == "numpy"
        assert r["dtype"] == "float32"
        # the sgemm reference is timed for a minimum time; the rest --repeat times
        assert len(r["times_s"]) >= 2 if r["runner"] == "numpy_sgemm" else len(
            r["times_s"]) == 2
        assert r["best_s"] == min(r["times_s"]) > 0
        assert r["gflops"] == pytest.approx(r["flops"] / r["best_s"] / 1e9)
        assert r["memory_bytes"] > 0
        assert r["memory_method"] in ("tracemalloc", "rss")
        assert r["ratio_sdpa"] is None  # torch is not in this sweep


def test_flops_and_ratios(run: dict) -> None:
    rows = run["json"]["results"]
    for r in rows:
        length = r["q_len"]
        allowed = np.tril(np.ones((length, length), dtype=bool)).sum() if r["mask"] == "causal" \
            else length * length
        attention = 2 * r["batch"] * r["heads"] * allowed * (8 + 8)
        if r["runner"] == "numpy_sgemm":
            # a square GEMM holding the same work, to the nearest side n
            n = side(attention)
            assert r["flops"] == 2 * n**3
            assert 2 * (n - 1) ** 3 < attention < 2 * (n + 1) ** 3
        else:
            assert r["flops"] == attention
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mask"], r["q_len"]), []).append(r)
    for group in groups.values():
        attention = [r["ratio_fastest"] for r in group if r["runner"] != "numpy_sgemm"]
        assert min(attention) == 1.0
        assert all(x >= 1.0 for x in attention)
        (sgemm,) = [r for r in group if r["runner"] == "numpy_sgemm"]
        assert sgemm["ratio_fastest"] is None  # a reference, not an attention kernel
        assert sgemm["ratio_sgemm"] == 1.0
        for r in group:
            assert r["ratio_sgemm"] == pytest.approx(r["gflops"] / sgemm["gflops"])


def test_table_printed(run: dict) -> None:
    text = run["stdout"]
    for mask in ("none", "causal"):
        assert f"device=cpu dtype=float32 mask={mask}" in text
    for name in RUNNERS:
        assert name in text
    assert "GFLOP/s" in text
    assert "of sgemm" in text
    assert "numpy_sgemm+" in text  # marked as the reference, explained below the table
    assert "+ reference: NumPy's float32 GEMM on square matrices" in text


def test_plot_written(run: dict) -> None:
    pytest.importorskip("matplotlib")
    png = run["out"] / "portattn-bench-cpu.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now fails
    args = [*TINY, "--kernels", "tiled", "--sizes", "16", "--repeat", "1", "--no-causal"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "matplotlib" in err
    assert "pip install matplotlib" in err
    assert not (tmp_path / "portattn-bench-cpu.png").exists()
    assert (tmp_path / "portattn-bench-cpu.json").exists()


def test_unknown_kernel(tmp_path, capsys) -> None:
    assert main([*TINY, "--kernels", "no_such_kernel", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no_such_kernel" in err
    assert "tiled" in err  # the installed ones are listed


def test_bad_sizes() -> None:
    with pytest.raises(SystemExit):
        main(["--sizes", "0,abc"])


def test_causal_pairs_count_the_mask() -> None:
    for lq, lk in ((1, 1), (5, 5), (3, 7), (7, 3)):
        # bottom-right: query i sees key j when j <= i + (lk - lq)
        allowed = np.tril(np.ones((lq, lk), dtype=bool), k=lk - lq).sum()
        assert causal_pairs(lq, lk) == allowed
    shape = Shape(batch=2, heads=3, head_dim=4, value_head_dim=5)
    assert flops(shape, 6, 6, causal=False) == 2 * 2 * 3 * 36 * 9
    q, k, v = shape.arrays(6)
    assert attention_flops(q.shape, k.shape, v.shape, True) == flops(shape, 6, 6, True)


def test_sgemm_side() -> None:
    assert side(2 * 1000**3) == 1000
    assert side(2 * 1000**3 + 10) == 1000
    assert side(1) == 1


def test_history_skips_predicted_overruns() -> None:
    from portattn_bench.sweep import History

    history = History(SweepConfig(max_time=1.0, max_memory=1000.0))

    class FakeCase:
        series = ("k", "numpy", "float32", "none")

        def __init__(self, length: int) -> None:
            self.length = length

    assert history.skip_reason(FakeCase(512)) is None
    history.add(FakeCase(512), seconds=0.3, memory=100)
    assert history.skip_reason(FakeCase(1024)) is not None  # 0.3 s * 4 > 1 s
    history = History(SweepConfig(max_time=100.0, max_memory=1000.0))
    history.add(FakeCase(512), seconds=0.1, memory=300)
    assert "memory" in history.skip_reason(FakeCase(1024))  # 300 B * 4 > 1000 B
    history.fail(FakeCase(1024))
    assert "failed at L=1024" in history.skip_reason(FakeCase(2048))


def test_import_portattn_leaves_bench_alone() -> None:
    code = "import sys, portattn; portattn.kernels(); print('portattn_bench' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_core_command_hands_over(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "portattn", "bench", *TINY, "--kernels",
                             "tiled", "--sizes", "16", "--no-causal", "--no-plot",
                             "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "tiled" in result.stdout
    assert (tmp_path / "portattn-bench-cpu.json").exists()


def test_core_command_without_the_bench(monkeypatch, capsys) -> None:
    import importlib.metadata

    from portattn.__main__ import main as portattn_main

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])  # not installed
    assert portattn_main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "portattn-bench" in err
    assert "pip install ./bench/portattn-bench" in err


def test_backends_are_the_test_suites() -> None:
    from portattn_bench.backends import BENCH_BACKENDS

    from portattn.testing import BACKEND_NAMES

    assert sorted(BENCH_BACKENDS) == sorted(BACKEND_NAMES)


def test_backend_of_another_device() -> None:
    from portattn_bench.backends import get

    with pytest.raises(ValueError, match=r"'torch' for device=cuda; known: cupy, torch_cuda"):
        get("torch", "cuda")


def test_summary_names_the_blas_kernels() -> None:
    machine = {"cpu": "x86", "cpus_usable": 2, "python": "3.11", "blas": [
        {"user_api": "blas", "internal_api": "openblas", "version": "0.3.31",
         "architecture": "Haswell"},
        {"user_api": "blas", "internal_api": "mkl", "version": "2025"},
        {"user_api": "openmp", "internal_api": "openmp"}]}
    assert "BLAS openblas 0.3.31 (Haswell), mkl 2025;" in summary(machine)


def _compiling_call(first: float):
    """A call that takes ``first`` seconds once (say, compiling), then no time."""
    calls = []

    def call():
        calls.append(None)
        if len(calls) == 1:
            time.sleep(first)

    return call, calls


@pytest.mark.parametrize("first_of_series", [True, False])
def test_a_slow_first_call_is_retried_only_at_the_start_of_a_series(first_of_series):
    call, calls = _compiling_call(0.05)
    m = measure(call, lambda result: result, repeat=3, warmup=1, budget=10.0, max_time=0.02,
                memory=None, first_of_series=first_of_series)
    if first_of_series:  # the second warm-up was quick: three timed calls follow
        assert len(calls) == 5
        assert len(m.times) == 3
        assert max(m.times) < 0.05  # not the slow one
    else:  # a case predicted from smaller sizes: one slow call is its only sample
        assert len(calls) == 1
        assert len(m.times) == 1
        assert m.times[0] >= 0.05


def test_a_first_case_slow_twice_is_one_sample():
    calls = []
    m = measure(lambda: (calls.append(None), time.sleep(0.03)), lambda result: result,
                repeat=3, warmup=1, budget=10.0, max_time=0.02, memory=None,
                first_of_series=True)
    assert len(calls) == 2  # retried once, not again
    assert len(m.times) == 1
    assert m.times[0] >= 0.03


def _row(runner: str, backend: str, kind: str, length: int, best: float,
         median: float) -> dict:
    return {"status": "ok", "runner": runner, "backend": backend, "dtype": "float32",
            "mask": "none", "kind": kind, "q_len": length, "best_s": best,
            "median_s": median, "memory_bytes": 2**20 * length, "memory_method": "rss"}


def test_plot_colours_kernels_and_styles_libraries(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from portattn_bench import plot as _plot

    figures: list = []
    monkeypatch.setattr(_plot, "_figure_class", lambda: lambda **kw: figures.append(
        Figure(**kw)) or figures[-1])
    rows = [_row(r, b, k, n, 1e-3 * n, 1e-3 * n)
            for r, b, k in [("tiled", "numpy", "kernel"), ("tiled", "torch", "kernel"),
                            ("reference", "numpy", "kernel"),
                            ("numpy_sgemm", "numpy", "reference")]
            for n in (16, 32)]
    _plot.plot(rows, tmp_path / "p.png", "t")
    top, bottom = figures[0].axes[:2]
    lines = {line.get_label(): line for line in top.get_lines()}
    tiled_numpy, tiled_torch = lines["tiled [numpy]"], lines["tiled [torch]"]
    assert tiled_numpy.get_color() == tiled_torch.get_color()
    assert tiled_numpy.get_linestyle() != tiled_torch.get_linestyle()
    assert lines["reference [numpy]"].get_color() != tiled_numpy.get_color()
    memory = {line.get_label() for line in bottom.get_lines()}
    assert "tiled [numpy]" in memory
    assert not any("GEMM" in label for label in memory)  # no sgemm line in memory panels


def test_a_busy_machine_is_named_in_a_warning() -> None:
    from portattn_bench.report import busy_warning

    quiet = [_row("tiled", "numpy", "kernel", 16, 1.0, 1.2)]
    assert busy_warning(quiet) is None
    busy = [*quiet, _row("reference", "numpy", "kernel", 32, 1.0, 86.0)]
    assert busy_warning(busy).startswith(
        "warning: the machine looks busy: median/best up to 86.0x (reference [numpy] at L=32)")


def _slow_at_first(count: int, seconds: float):
    """A call slowed by other work for its first ``count`` calls, then quick."""
    calls = []

    def call():
        calls.append(None)
        if len(calls) <= count:
            time.sleep(seconds)

    return call, calls


def test_a_rate_is_the_best_of_calls_over_a_minimum_time():
    # warm-up + 3 timed calls all slowed: the plain measurement reports the slow time
    call, _ = _slow_at_first(4, 0.02)
    m = measure(call, lambda result: result, repeat=3, warmup=1, budget=10.0, max_time=5.0,
                memory=None)
    assert min(m.times) >= 0.02
    # timed on for 0.15 s, it sees the machine free again
    call, _ = _slow_at_first(4, 0.02)
    m = measure(call, lambda result: result, repeat=3, warmup=1, budget=10.0, max_time=5.0,
                memory=None, min_time=0.15)
    assert min(m.times) < 0.01
    assert 3 < len(m.times) <= MAX_SAMPLES
    # and never past the budget, nor past MAX_SAMPLES
    call, _ = _slow_at_first(0, 0.0)
    m = measure(call, lambda result: result, repeat=3, warmup=1, budget=10.0, max_time=5.0,
                memory=None, min_time=60.0)
    assert len(m.times) == MAX_SAMPLES


def test_settling_idles_before_the_first_call():
    started = time.perf_counter()
    measure(lambda: None, lambda result: result, repeat=1, warmup=0, budget=1.0,
            max_time=1.0, memory=None, settle=0.05)
    assert time.perf_counter() - started >= 0.05


def test_the_sgemm_reference_settles_and_takes_its_best_over_time():
    from portattn_bench.runners import BASELINES, SGEMM, KernelRunner

    assert SGEMM.settle > 0
    assert SGEMM.min_time > 0
    for runner in (*BASELINES, KernelRunner("tiled", "portattn 0.1.0")):
        assert (runner.settle, runner.min_time) == (0.0, 0.0)  # attention: as repeated


def _sgemm(length: int, best: float, mask: str = "none") -> dict:
    return {**_row("numpy_sgemm", "numpy", "reference", length, best, best), "mask": mask,
            "device": "cpu"}


def test_a_reference_that_falls_as_the_length_grows_is_named_in_a_warning() -> None:
    from portattn_bench.report import reference_warning, timing_warnings, unreliable

    # 520 within noise of 512 (more work, a little less time): not a slowed reference
    steady = [_sgemm(256, 0.4e-3), _sgemm(512, 1.8e-3), _sgemm(520, 1.7e-3),
              _sgemm(256, 0.2e-3, "causal")]
    assert reference_warning(steady) is None
    assert timing_warnings(steady) == []
    assert unreliable(steady) == []
    slowed = [*steady, _sgemm(1024, 0.9e-3, "causal"), _sgemm(512, 12e-3, "causal")]
    assert reference_warning(slowed) == (
        "warning: the sgemm reference took 12 ms at L=512 but 900 us at L=1024 "
        "(mask=causal): more work in less time, so other work slowed it at L=512, where "
        "the 'of sgemm' shares are too high; run again on an idle machine")
    assert unreliable(slowed) == [slowed[-1]]
    busy = [*slowed, _row("tiled", "numpy", "kernel", 256, 1.0, 3.0)]
    assert [w.split(":")[1] for w in timing_warnings(busy)] == [
        " the machine looks busy",
        " the sgemm reference took 12 ms at L=512 but 900 us at L=1024 (mask=causal)"]
    assert unreliable(busy) == [slowed[-1], busy[-1]]


def _captured_figures(monkeypatch) -> list:
    from matplotlib.figure import Figure
    from portattn_bench import plot as _plot

    figures: list = []
    monkeypatch.setattr(_plot, "_figure_class", lambda: lambda **kw: figures.append(
        Figure(**kw)) or figures[-1])
    return figures


def test_the_plot_shows_the_warnings_and_rings_what_they_are_about(tmp_path,
                                                                    monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from portattn_bench.plot import plot

    figures = _captured_figures(monkeypatch)
    rows = [_sgemm(256, 12e-3), _sgemm(512, 0.9e-3), _row("tiled", "numpy", "kernel", 256,
                                                          1e-3, 1e-3)]
    for r in rows:
        r["device"] = "cpu"
    plot(rows, tmp_path / "quiet.png", "t")
    assert not figures[0].get_supxlabel()
    assert all("unreliable" not in line.get_label() for line in figures[0].axes[0].get_lines())

    warnings = ["warning: the machine looks busy: " + "x " * 100, "warning: the sgemm one"]
    plot(rows, tmp_path / "busy.png", "t", warnings)
    text = figures[1].get_supxlabel()
    assert " ".join(text.split()) == " ".join(" ".join(warnings).split())
    (ring,) = [line for line in figures[1].axes[0].get_lines()
               if line.get_label().startswith("unreliable time")]
    assert (list(ring.get_xdata()), list(ring.get_ydata())) == ([256], [12e-3])
    assert (tmp_path / "busy.png").stat().st_size > 0


def test_the_report_prints_and_plots_its_warnings(tmp_path, monkeypatch, capsys) -> None:
    from portattn_bench import plot as _plot
    from portattn_bench import report

    monkeypatch.setattr(report, "timing_warnings", lambda rows: ["warning: made up"])
    plotted: list = []
    monkeypatch.setattr(_plot, "plot", lambda rows, path, title, warnings=(): plotted.append(
        warnings))
    assert main([*TINY, "--kernels", "tiled", "--sizes", "16", "--out", str(tmp_path)]) == 0
    assert "\nwarning: made up\n" in capsys.readouterr().out
    assert plotted == [["warning: made up"]]
