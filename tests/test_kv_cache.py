"""KV-cache decoding equals the full causal pass; the cache's bookkeeping and errors."""

from __future__ import annotations

import numpy as np
import pytest

from portattn import masks
from portattn.kv_cache import KVCache
from portattn.multihead import MultiHeadAttention
from portattn.testing import assert_close


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_decoding_equals_the_full_causal_pass(backend, num_kv_heads):
    layer = MultiHeadAttention.init(16, 4, num_kv_heads, seed=1, dtype="float64")
    x = np.random.default_rng(2).standard_normal((2, 7, 16))
    expected = layer(x, mask=masks.causal())
    on_backend = layer.to(backend.xp, device=backend.device, dtype="float32")
    xb = backend.asarray(x, "float32")
    cache = on_backend.new_cache(2, capacity=8)
    # a prompt of 3, a chunk of 2 (bottom-right alignment matters), then single tokens
    steps = [on_backend(xb[:, a:b, :], mask=masks.causal(), cache=cache)
             for a, b in ((0, 3), (3, 5), (5, 6), (6, 7))]
    assert cache.length == 7
    got = np.concatenate([backend.to_numpy(s) for s in steps], axis=-2)
    assert_close(got, expected, "float32")


def test_append_keeps_everything_in_order(backend):
    cache = KVCache.empty((2,), 3, 4, 6, value_head_dim=5, xp=backend.xp,
                          device=backend.device)
    assert (cache.capacity, cache.length) == (6, 0)
    rng = np.random.default_rng(3)
    keys = [rng.standard_normal((2, 3, n, 4)) for n in (2, 1, 3)]
    values = [rng.standard_normal((2, 3, n, 5)) for n in (2, 1, 3)]
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        all_k, all_v = cache.append(backend.asarray(k, "float32"), backend.asarray(v, "float32"))
        np.testing.assert_array_equal(backend.to_numpy(all_k), np.concatenate(
            keys[:i + 1], axis=-2).astype(np.float32))
        np.testing.assert_array_equal(backend.to_numpy(all_v), np.concatenate(
            values[:i + 1], axis=-2).astype(np.float32))
    assert cache.length == 6
    cache.reset()
    assert cache.length == 0
    assert tuple(cache.keys.shape) == (2, 3, 0, 4)


def test_overflow_is_an_error_and_writes_nothing(backend):
    cache = KVCache.empty(1, 2, 4, 4, xp=backend.xp, device=backend.device)
    three = backend.asarray(np.ones((1, 2, 3, 4)), "float32")
    cache.append(three, three)
    two = backend.asarray(np.full((1, 2, 2, 4), 7.0), "float32")
    with pytest.raises(ValueError, match=r"overflow.*2 positions at length=3.*capacity=4"):
        cache.append(two, two)
    assert cache.length == 3
    assert not (backend.to_numpy(cache.keys) == 7).any()


def test_layer_overflow(backend):
    layer = MultiHeadAttention.init(8, 2, xp=backend.xp, device=backend.device)
    cache = layer.new_cache(1, capacity=2)
    x = backend.asarray(np.ones((1, 3, 8)), "float32")
    with pytest.raises(ValueError, match=r"capacity=2"):
        layer(x, mask=masks.causal(), cache=cache)


def test_bad_appends(backend):
    cache = KVCache.empty(2, 2, 4, 5, xp=backend.xp, device=backend.device)
    good = backend.asarray(np.ones((2, 2, 1, 4)), "float32")
    bad = backend.asarray(np.ones((2, 3, 1, 4)), "float32")
    with pytest.raises(ValueError, match=r"key must have shape \(2, 2, 'n', 4\).*\(2, 3, 1, 4\)"):
        cache.append(bad, good)
    with pytest.raises(ValueError, match=r"value must have shape"):
        cache.append(good, bad)
    longer = backend.asarray(np.ones((2, 2, 2, 4)), "float32")
    with pytest.raises(ValueError, match=r"key.shape\[-2\]=1, value.shape\[-2\]=2"):
        cache.append(good, longer)
    if "float64" in backend.dtypes:
        wide = backend.asarray(np.ones((2, 2, 1, 4)), "float64")
        with pytest.raises(TypeError, match=r"key.dtype=float64 differs .* float32"):
            cache.append(wide, wide)
    other = pytest.importorskip("array_api_strict" if backend.name == "numpy" else "numpy")
    foreign = other.asarray(np.ones((2, 2, 1, 4), dtype=np.float32))
    with pytest.raises(TypeError, match=r"key must come from the cache's library"):
        cache.append(foreign, foreign)
    assert cache.length == 0


def test_bad_construction(backend):
    kwargs = {"xp": backend.xp, "device": backend.device}
    with pytest.raises(ValueError, match=r"capacity=0"):
        KVCache.empty(1, 2, 4, 0, **kwargs)
    with pytest.raises(ValueError, match=r"num_kv_heads=2.5"):
        KVCache.empty(1, 2.5, 4, 8, **kwargs)
    with pytest.raises(ValueError, match=r"dtype='int32'"):
        KVCache.empty(1, 2, 4, 8, dtype="int32", **kwargs)


def test_cache_is_for_self_attention(backend):
    layer = MultiHeadAttention.init(8, 2, xp=backend.xp, device=backend.device)
    x = backend.asarray(np.ones((1, 1, 8)), "float32")
    with pytest.raises(ValueError, match=r"both context and cache"):
        layer(x, context=x, cache=layer.new_cache(1, 4))


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_cache_travels_and_branches(backend, how):
    # to another process (pickle), or a beam search's second branch (deepcopy)
    import copy
    import pickle

    if how == "pickle" and backend.name in ("torch_cuda", "jax_cuda", "cupy"):
        pytest.skip("device arrays pickle through their library's own rules")
    xp = backend.xp
    cache = KVCache.ragged(*(backend.asarray(np.zeros((2, 1, 6, 4)), "float32")
                             for _ in range(2)), backend.asarray(np.array([1, 3])))
    twin = pickle.loads(pickle.dumps(cache)) if how == "pickle" else copy.deepcopy(cache)
    step = backend.asarray(np.ones((2, 1, 1, 4)), "float32")
    keys, _ = twin.append(step, step)
    assert twin.length == cache.length + 1
    assert backend.to_numpy(twin.lengths).tolist() == [2, 4]
    assert backend.to_numpy(cache.lengths).tolist() == [1, 3]  # the original is untouched
    assert float(xp.sum(keys)) == 8.0
