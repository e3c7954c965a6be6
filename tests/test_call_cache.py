"""Repeated calls reuse the remembered description and kernel choice, and only when
nothing that decides them has changed."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn._dispatch import _call_cache, _registry
from portattn._kernels import ReferenceKernel, TiledKernel

rng = np.random.default_rng(0)


def _qkv(lq=8, lk=8, heads=2, d=16):
    return tuple(rng.standard_normal((1, heads, n, d)).astype(np.float32)
                 for n in (lq, lk, lk))


class Recorder(TiledKernel):
    """The tiled kernel under another name, counting its runs; refuses gradients."""

    name = "recorder"
    grad = False
    priority = 900
    runs = 0

    def run(self, inputs):
        type(self).runs += 1
        return super().run(inputs)


@pytest.fixture
def recorder(monkeypatch):
    """Dispatch sees reference, tiled and the recorder; describe() calls are counted."""
    monkeypatch.setattr(Recorder, "runs", 0)
    entries = _registry.order([*_registry.builtin_entries(),
                               _registry.KernelEntry("recorder", Recorder(), "test", "0")])
    monkeypatch.setattr(_registry, "_discovered", (entries, None))
    monkeypatch.setattr(_call_cache, "_calls", {})
    described = []
    real = _call_cache.describe
    monkeypatch.setattr(_call_cache, "describe",
                        lambda *a, **kw: described.append(1) or real(*a, **kw))
    return described


def _expected(q, k, v, **kwargs):
    return ReferenceKernel().run(portattn._inputs.describe(q, k, v, **kwargs))[0]


def test_repeated_calls_describe_once_and_use_the_new_arrays(recorder):
    for _ in range(3):
        q, k, v = _qkv()  # new values every time
        out = portattn.attention(q, k, v, mask=masks.causal())  # a new mask object too
        np.testing.assert_allclose(out, _expected(q, k, v, mask=masks.causal()), rtol=1e-5,
                                   atol=1e-6)
    assert len(recorder) == 1
    assert Recorder.runs == 3


@pytest.mark.parametrize("change", [
    {"lq": 4}, {"lk": 12}, {"heads": 4}, {"d": 8},
])
def test_another_shape_is_described_again(recorder, change):
    portattn.attention(*_qkv())
    portattn.attention(*_qkv(**change))
    assert len(recorder) == 2


@pytest.mark.parametrize("options", [
    {"scale": 0.5}, {"softcap": 3.0}, {"return_lse": True}, {"mask": masks.causal()},
    {"mask": masks.causal("top_left")}, {"mask": masks.causal() & masks.sliding_window(2)},
    {"kernel": "tiled"},
])
def test_other_options_are_described_again(recorder, options):
    q, k, v = _qkv()
    portattn.attention(q, k, v)
    portattn.attention(q, k, v, **options)
    portattn.attention(q, k, v, **options)
    assert len(recorder) == 2


def test_other_dtype_is_described_again(recorder):
    q, k, v = _qkv()
    portattn.attention(q, k, v)
    out = portattn.attention(*(a.astype(np.float64) for a in (q, k, v)))
    assert out.dtype == np.float64
    assert len(recorder) == 2


def test_context_overrides_apply_to_remembered_calls(recorder):
    q, k, v = _qkv()
    portattn.attention(q, k, v)
    with portattn.disable_kernels("recorder"):
        portattn.attention(q, k, v)
    with portattn.use_kernel("reference"):
        portattn.attention(q, k, v)
    portattn.attention(q, k, v)
    assert Recorder.runs == 2


def test_a_refreshed_registry_is_asked_again(recorder, monkeypatch):
    q, k, v = _qkv()
    portattn.attention(q, k, v)
    monkeypatch.setattr(_registry, "_discovered",
                        (_registry.order(_registry.builtin_entries()), None))
    portattn.attention(q, k, v)
    assert Recorder.runs == 1
    assert len(recorder) == 2


def test_bad_arguments_still_fail_after_a_good_call(recorder):
    q, k, v = _qkv()
    portattn.attention(q, k, v, scale=1, dropout_p=0)
    with pytest.raises(ValueError, match="scale must be a finite real number; got scale=True"):
        portattn.attention(q, k, v, scale=True)  # equal to 1 as a dict key
    with pytest.raises(ValueError, match="dropout_p must be a float"):
        portattn.attention(q, k, v, dropout_p=False)
    with pytest.raises(TypeError, match="must share one dtype"):
        portattn.attention(q, k, v.astype(np.float64))


def test_calls_with_arrays_in_options_are_not_remembered(recorder):
    q, k, v = _qkv()
    lengths = np.array([5])
    bias = np.zeros((8, 8), np.float32)
    for _ in range(2):
        portattn.attention(q, k, v, mask=masks.key_lengths(lengths))
        portattn.attention(q, k, v, bias=bias)
        portattn.attention(q, k, v, mask=np.ones((8, 8), bool))
    assert len(recorder) == 6
    assert not _call_cache._calls


def test_no_array_is_kept_alive(recorder):
    q, k, v = _qkv()
    out = portattn.attention(q, k, v)
    refs = [weakref.ref(a) for a in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert all(r() is None for r in refs)


def test_the_number_of_signatures_is_bounded(recorder):
    for n in range(1, _call_cache.MAX_SIGNATURES + 20):
        portattn.attention(*_qkv(lq=n, d=2))
    assert 0 < len(_call_cache._calls) <= _call_cache.MAX_SIGNATURES


def test_gradients_are_part_of_the_signature(recorder):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.asarray(a) for a in _qkv())
    portattn.attention(q, k, v)
    assert Recorder.runs == 1
    q.requires_grad_(True)
    out = portattn.attention(q, k, v)  # the recorder cannot do gradients: tiled runs
    assert Recorder.runs == 1
    out.sum().backward()
    assert q.grad is not None
    with torch.no_grad():
        portattn.attention(q, k, v)
    assert Recorder.runs == 2


class UnhashableDevice:
    """Like CuPy's ``cupy.cuda.Device``: ``==`` and no hash. Equal to ``"cpu"`` too, so
    NumPy's functions take it as their ``device=``."""

    __hash__ = None

    def __eq__(self, other):
        return isinstance(other, UnhashableDevice) or other == "cpu"

    def __repr__(self):
        return "<CPU Device 0>"


class OnUnhashableDevice(np.ndarray):
    """NumPy arrays whose standard ``.device`` is an :class:`UnhashableDevice`."""

    @property
    def device(self):
        return UnhashableDevice()


@pytest.mark.parametrize("options", [
    {}, {"mask": masks.causal()}, {"mask": masks.key_lengths(np.array([5]))},
    {"bias": np.ones((8, 8), np.float32)}, {"return_lse": True},
], ids=["plain", "causal", "key_lengths", "bias", "lse"])
def test_arrays_on_an_unhashable_device_run(recorder, monkeypatch, options):
    # Every CuPy call on a GPU once failed before any kernel ran, with "unhashable type:
    # 'cupy.cuda.device.Device'": the device's kind was remembered in a dict keyed by the
    # device, and the call's signature holds the devices too.
    from portattn._inputs import _describe

    monkeypatch.setattr(_describe, "device_of", lambda a: UnhashableDevice())
    q, k, v = (a.view(OnUnhashableDevice) for a in _qkv())
    want = _expected(*(np.asarray(a) for a in (q, k, v)), **options)
    for _ in range(2):  # the second call through what the first left in the caches
        out = portattn.attention(q, k, v, **options)
        np.testing.assert_allclose(np.asarray(out[0] if "return_lse" in options else out),
                                   want, rtol=1e-5, atol=1e-6)
    assert Recorder.runs == 2
    # and remembered by the device's name: described once unless an array option
    # (a bias) or a mask holding arrays keeps the call from being remembered
    remembered = "bias" not in options and not getattr(options.get("mask"), "arrays", ())
    assert len(recorder) == (1 if remembered else 2)
    assert portattn.explain(q, k, v, **options).kernel.name == "recorder"
