"""On torch's CUDA, triton_flash defers to the kernels a torch user already has, and the
evidence this plugin ships (the H200 GPU check) decides where it runs instead.

The calls are described on the CPU and read as on a ``cuda sm_90`` or ``sm_80`` device
(a fake device class): no GPU is needed to check the rule and the shipped entries."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from portattn_triton import TritonFlashKernel

from portattn import masks
from portattn._dispatch._evidence import evidence_choice
from portattn.kernel import describe

PAIR = ["torch_sdpa", "torch_flex", "triton_flash"]


class Gpu:
    def __init__(self, capability):
        self.compute_capability = capability

    def __str__(self):  # one device per generation: the class is asked once per device
        return f"cuda:{self.compute_capability}"


def on_gpu(shape, mask=None, grad=False, capability="90", dtype=torch.bfloat16,
           kv_shape=None, **kwargs):
    def array(s):  # no memory behind the large shapes
        return torch.zeros((1,) * len(s), dtype=dtype).expand(*s)

    q = array(shape)
    k = v = array(kv_shape or shape)
    inputs = describe(q, k, v, mask=mask, **kwargs)
    return inputs._replace(device="cuda", device_obj=Gpu(capability), requires_grad=grad)


def pick(inputs):
    """What dispatch runs among torch's kernels and triton_flash, by the rule and the
    evidence: ``(kernel, note)``."""
    deferred = TritonFlashKernel.defers_to(inputs)
    default = deferred[0] if deferred else "triton_flash"
    found = evidence_choice(inputs, PAIR, default)
    return found if found is not None else (default, None)


def test_fused_sdpa_calls_defer_to_torch_sdpa_and_masks_to_flex():
    square = (4, 16, 4096, 128)
    assert TritonFlashKernel.defers_to(on_gpu(square)) == ("torch_sdpa",)
    assert TritonFlashKernel.defers_to(on_gpu(square, masks.causal())) == ("torch_sdpa",)
    ids = torch.zeros(4096, dtype=torch.int64)
    documents = masks.documents(ids) & masks.causal()
    assert TritonFlashKernel.defers_to(on_gpu(square, documents)) == ("torch_flex",)
    # what SDPA's flash backend does not fuse: causal on fewer queries than keys, a
    # bias, float32, head dims that differ
    decode = on_gpu((4, 16, 16, 128), masks.causal(), kv_shape=(4, 16, 4096, 128))
    assert TritonFlashKernel.defers_to(decode) == ("torch_flex",)
    assert TritonFlashKernel.defers_to(on_gpu(square, dtype=torch.float32)) == ()
    bias = torch.zeros(1, 1, 1, 1).expand(4, 16, 4096, 4096)
    assert TritonFlashKernel.defers_to(on_gpu(square, bias=bias)) == ()
    # elsewhere it defers to no one
    cpu = describe(torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16),
                   torch.zeros(1, 2, 8, 16))
    assert TritonFlashKernel.defers_to(cpu) == ()


@pytest.mark.parametrize(("shape", "mask", "grad", "kernel"), [
    ((4, 16, 4096, 128), "causal", True, "torch_sdpa"),     # training: 2.35x
    ((4, 16, 4096, 128), None, True, "torch_sdpa"),         # training: 2.32x
    ((4, 16, 4096, 64), "causal", False, "torch_sdpa"),     # forward: 1.58x
    ((4, 16, 4096, 128), "causal", False, "torch_sdpa"),    # forward: 1.02x
    ((4, 16, 4096, 128), None, False, "triton_flash"),      # forward: 1.12x
    ((4, 16, 4096, 64), None, False, "triton_flash"),       # forward: 1.27x
    ((1, 16, 8192, 128), "documents", False, "torch_flex"),  # 7.8x
])
def test_on_sm_90_the_shipped_evidence_picks(shape, mask, grad, kernel):
    made = {None: None, "causal": masks.causal(),
            "documents": masks.documents(torch.arange(shape[2]) // 1400) & masks.causal()}
    chosen, note = pick(on_gpu(shape, made[mask], grad=grad))
    assert chosen == kernel
    assert note.startswith("measured on NVIDIA H200, 2026-12-04: ")


def test_decode_goes_to_sdpa_on_sm_90():
    inputs = on_gpu((4, 32, 1, 128), kv_shape=(4, 8, 32768, 128))
    chosen, note = pick(inputs)
    assert chosen == "torch_sdpa"
    assert "torch_sdpa 1.64x faster than triton_flash" in note


def test_without_evidence_for_the_device_the_rule_stands():
    # nothing was measured on sm_80: torch's kernels run what they fuse and what Flex takes
    assert pick(on_gpu((4, 16, 4096, 128), capability="80")) == ("torch_sdpa", None)
    assert pick(on_gpu((4, 16, 4096, 128), masks.sliding_window(256),
                       capability="80")) == ("torch_flex", None)
    # nor at another size band on sm_90
    assert pick(on_gpu((4, 16, 256, 128))) == ("torch_sdpa", None)


def test_the_shipped_entries_are_what_the_gpu_check_figures_say():
    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("evidence", root / "bench/gpu/evidence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figures = [str(root / "bench/figures" / f"gpu-check-h200-2026-12-04-{run}.json")
               for run in ("full", "tables-speed")]
    made = json.loads(json.dumps(module.evidence(figures)))
    shipped = importlib.resources.files("portattn_triton").joinpath("evidence.json")
    assert json.loads(shipped.read_text()) == made
