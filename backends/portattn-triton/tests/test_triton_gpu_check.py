"""The parts of the GPU check (``bench/gpu_check.py``, ``bench/gpu/``) that need no GPU.

The check runs end to end on CPU here (``--device cpu``: the kernels through Triton's
interpreter, SDPA's math backend as the peer), its JSON is read back, and each way it
must fail (no triton_flash, another kernel chosen, nothing run, a wrong, unwritten or
unrepeatable result) is provoked. ``slow``: the wheels built by ``pack.py``, installed
by ``run.sh`` with no index, run the check from outside the checkout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from portattn_triton import Config

import portattn
from portattn.kernel import Kernel
from portattn.testing import conformance_cases, get_backend

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "gpu_check.py"
#: A small end-to-end selection: lengths with causal, decode with lengths, GQA decode.
E2E = ["--device", "cpu", "--quick", "--scale", "64", "--cases",
       "lengths_causal,decode_1,decode_16_causal,forward_causal"]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Perturbed(Kernel):
    """The reference kernel with its output scaled by ``1 + error``."""

    name = "perturbed"
    namespaces = frozenset({"torch"})
    devices = frozenset({"cpu"})
    dtypes = frozenset({"float32"})
    returns_lse = True
    error = 0.0

    def run(self, inputs):
        reference = next(e.kernel for e in portattn.kernels() if e.name == "reference")
        out, lse, _ = reference.run(inputs)
        return out * (1 + self.error), lse, None


def _basic_case():
    return next(c for c in conformance_cases(_Perturbed) if c.name == "basic")


@pytest.mark.parametrize(("error", "status"), [(0.0, "ok"), (1e-3, "tf32"), (0.1, "FAIL")])
def test_check_one_grades_float32_results(gpu_check, error, status):
    tolerances = importlib.import_module("portattn.testing.oracle")
    before = tolerances.tolerance("float32")
    kernel = type("K", (_Perturbed,), {"error": error})
    got, _ = gpu_check.check_one(kernel, _basic_case(), get_backend("torch"))
    assert got == status
    assert tolerances.tolerance("float32") == before


def test_check_one_reports_skips(gpu_check):
    case = replace(_basic_case(), dtype="float16")
    got, detail = gpu_check.check_one(_Perturbed, case, get_backend("array_api_strict"))
    assert got == "skip"
    assert detail


def test_attention_flops(gpu_check):
    full = gpu_check.attention_flops(4, 16, 4096, 4096, 128, causal=False)
    assert full == 4 * 4 * 16 * 4096 * 4096 * 128
    assert gpu_check.attention_flops(4, 16, 4096, 4096, 128, causal=True) == full / 2


def test_sweep_configs_are_configs(gpu_check):
    configs = gpu_check.sweep_configs()
    assert configs
    assert all(isinstance(c, Config) for c in configs)


def test_triton_flash_is_listed_as_a_cuda_kernel(gpu_check):
    assert "triton_flash" in {k.name for k in gpu_check.cuda_kernels()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_main_without_gpu_exits_2(gpu_check, capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().out


def test_grad_cases_build(gpu_check):
    cases = gpu_check.grad_cases("cpu")
    assert {name for name, _, _ in cases} >= {"causal_bottom_right", "head_dim_256"}
    assert all(len(dims) == 7 for _, dims, _ in cases)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_grad_case_passes_on_the_interpreter(gpu_check, dtype):
    from portattn import masks

    mask = masks.causal() & masks.key_lengths(torch.tensor([20, 9]))
    status, detail = gpu_check.grad_case((2, 2, 1, 17, 20, 16, 24), {"mask": mask}, dtype,
                                         device="cpu")
    assert status == "ok", detail


def test_grad_case_skips_float32_head_dim_256(gpu_check):
    status, _ = gpu_check.grad_case((1, 1, 1, 4, 4, 256, 256), {}, "float32", device="cpu")
    assert status == "skip"


@pytest.fixture(scope="module")
def accuracy(gpu_check):
    import accuracy as module  # bench/gpu, put on sys.path by gpu_check

    return module


@pytest.fixture(scope="module")
def report_type(gpu_check):
    return gpu_check.Report


def test_end_to_end_on_cpu(gpu_check, tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main([*E2E, "--json", str(out)]) == 0, capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["failures"] == 0
    sections = {c["section"] for c in data["checks"] if c["status"] == "ok"}
    assert sections >= {"preflight", "conformance", "gradients", "accuracy", "speed"}
    accuracy = [c for c in data["checks"] if c["section"] == "accuracy"]
    # three cases x (float16, float32): --quick leaves out the rerun with plain TF32
    assert len(accuracy) == 3 * 2
    assert all(not c["name"].endswith("tf32 [torch]") for c in accuracy)
    grads = {c["name"]: c["status"] for c in data["checks"] if c["section"] == "gradients"}
    assert grads["triton_flash backward float32 chunks_sinks_bias"] == "ok"
    assert all(c["out_max_abs_error"] >= 0 for c in accuracy)
    rows = {row["name"]: row for row in data["figures"]["speed"]}
    assert set(rows) == {"forward_causal", "decode_1", "decode_16_causal"}
    speed = rows["forward_causal"]
    assert speed["triton_flash"]["seconds"] > 0
    assert speed["sdpa_math"]["seconds"] > 0
    assert speed["ratios"]["sdpa_math"] > 0
    assert speed["dispatched"]["seconds"] > 0
    assert speed["dispatched"]["kernel"]
    assert {row["name"] for row in data["figures"]["never_slower"]} == set(rows)
    assert data["machine"]["portattn_triton"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"])  # the day the run began
    evidence = json.loads((tmp_path / "evidence-check.json").read_text())
    assert evidence == {"format": 1, "entries": []}  # a CPU run measures no GPU


def test_preflight_fails_without_triton_flash(gpu_check, report_type, monkeypatch):
    import portattn

    monkeypatch.setattr(portattn, "kernels", lambda: [])
    report = report_type("cpu")
    assert not gpu_check.preflight(report, "cpu")
    assert report.failures == 1
    assert "no kernel named triton_flash" in report.checks[0]["detail"]


def test_preflight_fails_when_triton_flash_cannot_run_the_calls(gpu_check, report_type,
                                                                 monkeypatch):
    from portattn_triton import TritonFlashKernel

    report = report_type("cpu")
    monkeypatch.setattr(TritonFlashKernel, "not_supported_reasons",
                        classmethod(lambda cls, inputs: ["a reason"]))
    gpu_check.preflight(report, "cpu")
    assert report.failures >= 1
    assert any("triton_flash refused: a reason" in c["detail"] for c in report.checks
               if c["status"] == "FAIL")


def test_preflight_says_which_kernel_dispatch_runs(gpu_check, report_type):
    report = report_type("cpu")
    assert gpu_check.preflight(report, "cpu")
    runs = [c["detail"] for c in report.checks if c["name"].startswith("triton_flash can")]
    assert len(runs) == 4
    assert all(d.startswith("dispatch runs ") for d in runs)


def test_nothing_run_is_a_failure(report_type):
    report = report_type("cpu")
    assert report.failures == 1
    report.check("x", "skipped", "skip", "why")
    assert report.failures == 1
    report.check("x", "ran", "ok")
    assert report.failures == 0
    with pytest.raises(ValueError, match="status='pass'"):
        report.check("x", "y", "pass")


def _tamper(monkeypatch, how):
    """Make triton_flash's forward wrong in one way, through the launcher it calls."""
    import portattn_triton._autograd as autograd

    real = autograd.forward
    calls = []

    def tampered(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        calls.append(1)
        if how == "scaled":
            out = out * 1.01
        elif how == "unwritten":
            out = out.clone()
            out.view(-1)[0] = float("nan")
        elif how == "unrepeatable" and len(calls) % 2 == 0:
            lse = lse + 1e-3
        return out, lse

    monkeypatch.setattr(autograd, "forward", tampered)


@pytest.mark.parametrize(("how", "says"), [("scaled", "max |error|"), ("unwritten", "NaN"),
                                           ("unrepeatable", "bitwise")])
def test_accuracy_catches_wrong_results(accuracy, monkeypatch, how, says):
    case = accuracy.Case("small", (1, 4, 2, 40, 90, 32, 32), {"causal": "bottom_right"})
    status, detail, _ = accuracy.run_case(case, "float32", "cpu")
    assert status == "ok", detail
    _tamper(monkeypatch, how)
    status, detail, _ = accuracy.run_case(case, "float32", "cpu")
    assert status == "FAIL"
    assert says in detail


def test_accuracy_reads_bit_tiles_and_a_bias(accuracy):
    case = accuracy.Case("small", (1, 4, 2, 40, 90, 32, 32),
                         {"causal": "bottom_right", "documents": [30, 20, 40],
                          "window_sinks": (12, 3)}, bias="heads")
    status, detail, _ = accuracy.run_case(case, "float32", "cpu")
    assert status == "ok", detail
    small = accuracy.Case("g", (1, 2, 2, 64, 64, 16, 16), {"window_global": (4, [0, 40])})
    status, detail, _ = accuracy.run_case(small, "float16", "cpu")
    assert status == "ok", detail


def test_documents_speed_row_on_cpu(gpu_check):
    import timing  # bench/gpu, put on sys.path by gpu_check

    name, dims, sizes = timing.DOCUMENT_SHAPES[0]
    row = timing.time_documents(name, dims, sizes, "cpu", 64, repeats=1)
    assert row["shape"][2] == 128
    assert 0 < row["allowed"] < 0.5
    for label in ("triton_flash", "triton_flash_planned", "sdpa_dense_mask"):
        assert row[label]["seconds"] > 0, row[label]
    assert row["sdpa_dense_mask"]["max_abs_diff"] < 1e-4
    assert "flex_attention" in row


def test_accuracy_cases_cross_many_tiles(accuracy):
    assert max(c.dims[4] for c in accuracy.CASES) >= 32768
    assert any(c.dims[3] != c.dims[4] and c.dims[3] > 16 for c in accuracy.CASES)
    assert {k for c in accuracy.CASES for k in c.mask} == {
        "causal", "window", "key_lengths", "query_lengths", "documents", "window_global",
        "window_sinks"}
    assert any(c.softcap for c in accuracy.CASES)
    assert any(c.bias for c in accuracy.CASES)
    assert any(c.dims[1] != c.dims[2] for c in accuracy.CASES)


@pytest.mark.slow
def test_packed_wheels_install_and_run_without_an_index(tmp_path):
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "pack.py"), str(wheels)],
                   check=True, capture_output=True)
    assert len(list(wheels.glob("*.whl"))) == 5
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run.sh"), str(wheels),
                           str(out), *E2E[:-1], "decode_1", "--no-speed"],
                          env={**env, "PYTHON": sys.executable}, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["failures"] == 0
    # The installed wheels ran, not this checkout.
    assert not data["machine"]["portattn_path"].startswith(str(ROOT))
    assert not data["machine"]["portattn_triton_path"].startswith(str(ROOT))


def test_conformance_reaches_kernels_that_prefer_to_leave_small_calls():
    import portattn
    from portattn import masks

    flex = pytest.importorskip("portattn_torch").TorchFlexKernel
    q = torch.zeros(1, 2, 8, 16)
    small = portattn.explain(q, q, q, mask=masks.causal()).inputs
    # a preference of dispatch, not a refusal the kit (or kernel=) would meet
    assert any("scores <" in why for why in flex.dispatch_reasons(small))
    assert not any("scores <" in why for why in flex.not_supported_reasons(small))


def test_context_parallel_on_cpu(gpu_check, tmp_path, capsys):
    out = tmp_path / "check.json"
    argv = ["--device", "cpu", "--quick", "--no-speed", "--scale", "64", "--skip",
            "conformance,gradients,accuracy", "--cases", "causal_gqa,causal_ulysses",
            "--json", str(out)]
    assert gpu_check.main(argv) == 0, capsys.readouterr().out
    checks = [c for c in json.loads(out.read_text())["checks"]
              if c["section"] == "context_parallel"]
    names = {c["name"] for c in checks}
    assert "threads 4 ranks ring zigzag float32 causal_gqa" in names
    assert not any("window" in n for n in names)  # --cases chose
    from importlib.util import find_spec

    if find_spec("portattn_torch") is None:  # the torch.distributed engine's cases
        engine = [c for c in checks if c["name"].startswith("gloo")]
        assert [(c["status"], c["detail"]) for c in engine] == [
            ("skip", "portattn-torch is not installed")]
        checks = [c for c in checks if c not in engine]
    else:
        assert "gloo 1 rank ulysses zigzag float32 causal_ulysses" in names
    assert {c["status"] for c in checks} == {"ok"}
    for c in checks:
        worst = max(c["errors"].values())
        assert worst < (1e-5 if "float32" in c["name"] else 2e-2), (c["name"], worst)
