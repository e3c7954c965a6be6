"""Batched decoding from caches of different lengths: each step's output for sequence
``b`` equals attending its own cache alone."""

from __future__ import annotations

import re

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.kv_cache import KVCache
from portattn.multihead import MultiHeadAttention
from portattn.testing import assert_close, oracle

LENGTHS = [100, 1000, 2500, 4000]
STEPS = 3


def test_ragged_decode_equals_each_sequence_alone(backend):
    rng = np.random.default_rng(0)
    capacity = max(LENGTHS) + STEPS
    keys = rng.standard_normal((4, 2, capacity, 16)).astype(np.float32)
    values = rng.standard_normal((4, 2, capacity, 8)).astype(np.float32)
    for b, n in enumerate(LENGTHS):  # what each sequence's own cache holds
        keys[b, :, n:] = values[b, :, n:] = 0
    cache = KVCache.ragged(backend.asarray(keys), backend.asarray(values),
                           backend.asarray(np.array(LENGTHS)))
    own = [(keys[b, :, :n], values[b, :, :n]) for b, n in enumerate(LENGTHS)]
    for step in range(STEPS):
        q = rng.standard_normal((4, 4, 1, 16)).astype(np.float32)
        k = rng.standard_normal((4, 2, 1, 16)).astype(np.float32)
        v = rng.standard_normal((4, 2, 1, 8)).astype(np.float32)
        all_k, all_v = cache.append(backend.asarray(k), backend.asarray(v))
        assert all_k.shape == (4, 2, max(LENGTHS) + step + 1, 16)
        got = portattn.attention(backend.asarray(q), all_k, all_v, mask=cache.mask(1))
        own = [(np.concatenate([ok, k[b]], axis=-2), np.concatenate([ov, v[b]], axis=-2))
               for b, (ok, ov) in enumerate(own)]
        want = np.stack([oracle(q[b], ok, ov, mask=masks.causal())[0]
                         for b, (ok, ov) in enumerate(own)])
        assert_close(got, want, "float32")
    np.testing.assert_array_equal(backend.to_numpy(cache.lengths),
                                  np.array(LENGTHS) + STEPS)


def test_a_plain_cache_masks_bottom_right_causal(backend):
    cache = KVCache.empty(2, 1, 4, 8, xp=backend.xp, device=backend.device)
    assert cache.mask(3) == masks.causal()
    assert cache.lengths is None


@pytest.mark.parametrize(("lengths", "text"), [
    (np.array([1.0, 2.0]), "lengths must be an integer array of the batch shape (2,)"),
    (np.array([1, 2, 3]), "got lengths of type ndarray with shape (3,)"),
    (np.array([1, 9]), "lengths must lie in [0, capacity=8]; got lengths with min=1, max=9"),
])
def test_bad_ragged_lengths(lengths, text):
    buf = np.zeros((2, 1, 8, 4), dtype=np.float32)
    with pytest.raises(ValueError, match=re.escape(text)):
        KVCache.ragged(buf, buf, lengths)


def test_ragged_overflow_writes_nothing():
    buf = np.zeros((2, 1, 4, 2), dtype=np.float32)
    cache = KVCache.ragged(buf, buf, np.array([1, 4]))
    new = np.ones((2, 1, 1, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="overflow"):
        cache.append(new, new)
    np.testing.assert_array_equal(cache.lengths, [1, 4])



def test_a_layer_decodes_from_a_ragged_cache(backend):
    layer = MultiHeadAttention.init(16, 4, 2, seed=1, dtype="float64")
    rng = np.random.default_rng(5)
    prompts = [rng.standard_normal((1, n, 16)) for n in (3, 7)]
    steps = rng.standard_normal((2, 2, 16))
    want = np.concatenate([layer(np.concatenate([p, steps[b:b + 1]], axis=1),
                                 mask=masks.causal())[:, -2:]
                           for b, p in enumerate(prompts)])
    on = layer.to(backend.xp, device=backend.device, dtype="float32")
    buffers = []
    for p in prompts:  # each prompt into a cache of its own, then one ragged batch
        cache = on.new_cache(1, capacity=10)
        on(backend.asarray(p, "float32"), mask=masks.causal(), cache=cache)
        pad = ((0, 0), (0, 0), (0, 10 - cache.length), (0, 0))
        buffers.append([np.pad(backend.to_numpy(a), pad) for a in (cache.keys, cache.values)])
    keys, values = (np.concatenate(parts) for parts in zip(*buffers, strict=True))
    ragged = KVCache.ragged(backend.asarray(keys), backend.asarray(values),
                            backend.asarray(np.array([3, 7])))
    got = [backend.to_numpy(on(backend.asarray(steps[:, t:t + 1], "float32"), cache=ragged))
           for t in range(2)]
    assert_close(np.concatenate(got, axis=1), want, "float32")
    with pytest.raises(ValueError, match="a ragged KVCache brings its own mask"):
        on(backend.asarray(steps[:, :1], "float32"), mask=masks.causal(), cache=ragged)
