"""The conformance kit on the kernel, through Triton's interpreter on CPU torch tensors.

bfloat16 is left to the GPU check (``bench/gpu_check.py``): the interpreter's bfloat16
dot is inexact, and the kernel declines bfloat16 on CPU for that reason.
"""

from __future__ import annotations

import pytest
from portattn_triton import TritonFlashKernel

from portattn.testing import check_case, conformance_cases
from portattn.testing.plugin import require_backend

CASES = [c for c in conformance_cases(TritonFlashKernel) if c.dtype != "bfloat16"]
#: A few cases through DLPack from JAX CPU arrays (the path CuPy and JAX take on GPU).
JAX_CASES = [c for c in CASES if c.name in {"basic", "key_lengths", "grouped_query"}]


def test_cases_cover_float32_and_float16():
    assert {c.dtype for c in CASES} == {"float32", "float16"}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conformance_torch(case):
    check_case(TritonFlashKernel, case, require_backend("torch"))


@pytest.mark.parametrize("case", JAX_CASES, ids=str)
def test_conformance_jax_through_dlpack(case):
    check_case(TritonFlashKernel, case, require_backend("jax"))
