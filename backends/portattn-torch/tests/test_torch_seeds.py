"""Dropout seeds on torch: a seed value gives one mask whatever its integer dtype,
unsigned ones included (torch has no shifts for uint16/32/64 on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from portattn.testing.plugin import require_library

torch = require_library("torch")

import portattn  # noqa: E402
from portattn import dropout  # noqa: E402

VALUES = [0, 7, 2**31 + 3, 2**32 - 1, 2**40 + 17, 2**63 + 5, 2**64 - 1]
UNSIGNED = [torch.uint8, torch.uint16, torch.uint32, torch.uint64]


def _mask(seed):
    q = torch.zeros(2, 3, 16, 8)
    return dropout.mask(q, q, dropout_p=0.4, dropout_seed=seed)


@pytest.mark.parametrize("value", VALUES)
def test_unsigned_tensors_are_their_value(value):
    want = _mask(value)
    ran = 0
    for dtype in UNSIGNED:
        if value > torch.iinfo(dtype).max:
            continue
        for shape in ((), (1,)):
            seed = torch.tensor(value, dtype=dtype).reshape(shape)
            assert torch.equal(_mask(seed), want), (dtype, shape)
            ran += 1
    assert ran >= 2


def test_unsigned_words_are_read_as_words():
    words = [5, 0xFFFFFFF0, 3]
    value = sum(w << (32 * n) for n, w in enumerate(words))
    want = _mask(value)
    assert torch.equal(_mask(torch.tensor(words, dtype=torch.uint32)), want)
    assert torch.equal(_mask(torch.tensor(np.asarray(words, np.uint32))), want)
    high = [0xFFFFFFFFFFFFFFF0, 2**63 + 1]
    value = high[0] + (high[1] << 64)
    assert torch.equal(_mask(torch.tensor(high, dtype=torch.uint64)), _mask(value))


def test_an_unsigned_seed_on_a_call_runs():
    q = torch.randn(1, 2, 24, 8, dtype=torch.float64)
    seed = torch.tensor(2**32 - 1, dtype=torch.uint32)
    got = portattn.attention(q, q, q, dropout_p=0.3, dropout_seed=seed, kernel="tiled")
    want = portattn.attention(q, q, q, dropout_p=0.3, dropout_seed=2**32 - 1, kernel="tiled")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
