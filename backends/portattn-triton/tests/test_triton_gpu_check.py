"""The parts of ``bench/gpu_check.py`` that need no GPU."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from portattn_triton import Config

from portattn.kernel import Kernel
from portattn.testing import conformance_cases, get_backend

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "gpu_check.py"


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
        from portattn._reference import reference_attention

        out, lse, _ = reference_attention(inputs)
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
