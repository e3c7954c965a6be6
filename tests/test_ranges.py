"""Key/query ranges and per-sequence windows: every batch element equals attending its
own sequence alone; tiles outside every range are skipped; bad arrays are refused."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.testing import assert_close, oracle

KERNELS = [None, "tiled", "reference"]


def inputs(rng, batch=3, hq=4, hkv=2, lq=24, lk=40, d=8):
    q = rng.standard_normal((batch, hq, lq, d))
    k = rng.standard_normal((batch, hkv, lk, d))
    v = rng.standard_normal((batch, hkv, lk, d + 2))
    return q, k, v


def alone(q, k, v, mask=None):
    """float64 reference output of one sequence, padded rows left at zero."""
    if q.shape[-2] == 0:
        return np.zeros((*q.shape[:-1], v.shape[-1]))
    return oracle(q, k, v, mask=mask)[0]


def run(backend, q, k, v, mask, kernel):
    a = [backend.asarray(x, "float32") for x in (q, k, v)]
    return portattn.attention(*a, mask=mask, kernel=kernel)


def ints(backend, values):
    return backend.asarray(np.asarray(values, dtype=np.int64))


@pytest.mark.parametrize("kernel", KERNELS)
def test_key_ranges_equal_each_sequence_alone(backend, kernel):
    q, k, v = inputs(np.random.default_rng(0))
    start, stop = [0, 7, 33], [40, 29, 33]  # full, left and right padding, empty
    got = run(backend, q, k, v, masks.key_ranges(ints(backend, start), ints(backend, stop)),
              kernel)
    want = np.zeros((3, 4, 24, 10))
    for b in range(3):
        if start[b] < stop[b]:
            want[b] = alone(q[b], k[b, :, start[b]:stop[b]], v[b, :, start[b]:stop[b]])
    assert_close(got, want, "float32")


@pytest.mark.parametrize("kernel", KERNELS)
def test_left_padding_with_causal(backend, kernel):
    """Left-padded prompts: causal over the real tokens only, padded rows zero."""
    q, k, v = inputs(np.random.default_rng(1), lq=20, lk=20)
    pad = [0, 5, 12]
    mask = (masks.causal() & masks.key_ranges(ints(backend, pad), ints(backend, [20] * 3))
            & masks.query_ranges(ints(backend, pad), ints(backend, [20] * 3)))
    got = run(backend, q, k, v, mask, kernel)
    want = np.zeros((3, 4, 20, 10))
    for b, p in enumerate(pad):
        want[b, :, p:] = alone(q[b, :, p:], k[b, :, p:], v[b, :, p:], masks.causal())
    assert_close(got, want, "float32")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("window", [None, 3])
def test_sequence_window_aligns_to_each_sequence(backend, kernel, window):
    """flash-attn's varlen convention: query i of b sits at i + klen[b] - qlen[b]."""
    q, k, v = inputs(np.random.default_rng(2), lq=10, lk=30)
    qlen, klen = [10, 3, 1], [30, 17, 9]
    mask = masks.sequence_window(window, 0, query_lengths=ints(backend, qlen),
                                 key_lengths=ints(backend, klen))
    got = run(backend, q, k, v, mask, kernel)
    want = np.zeros((3, 4, 10, 10))
    own = masks.causal() if window is None else masks.sliding_window(window)
    for b in range(3):
        want[b, :, :qlen[b]] = alone(q[b, :, :qlen[b]], k[b, :, :klen[b]],
                                     v[b, :, :klen[b]], own)
    assert_close(got, want, "float32")


@pytest.mark.parametrize("kernel", KERNELS)
def test_ragged_decode_equals_each_sequence_alone(backend, kernel):
    """A batch of caches of lengths 100...4000, one new token each: every row equals
    attending its own sequence alone (here the whole cache of that sequence)."""
    lengths = [100, 1000, 2500, 4000]
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 2, 1, 16))
    k = rng.standard_normal((4, 2, 4000, 16))
    v = rng.standard_normal((4, 2, 4000, 16))
    mask = masks.sequence_causal(ints(backend, [1] * 4), ints(backend, lengths))
    got = run(backend, q, k, v, mask, kernel)
    want = np.stack([alone(q[b], k[b, :, :n], v[b, :, :n], masks.causal())
                     for b, n in enumerate(lengths)])
    assert_close(got, want, "float32")


def test_ranges_skip_tiles_outside_every_range():
    xp = pytest.importorskip("array_api_compat.numpy")
    mask = masks.key_ranges(np.array([64, 100]), np.array([200, 300])).bind(xp, (2,), 1, 8, 512)
    assert mask.key_range(0, 8, 8, 512) == (64, 300)
    assert mask.hides(0, 8, 0, 64, 8, 512)
    assert mask.hides(0, 8, 300, 512, 8, 512)
    assert not mask.hides(0, 8, 64, 128, 8, 512)
    assert mask.covers(0, 8, 100, 200, 8, 512)
    assert not mask.covers(0, 8, 64, 128, 8, 512)
    window = masks.sequence_causal(np.array([1, 1]), np.array([10, 300])).bind(
        xp, (2,), 1, 1, 512)
    assert window.key_range(0, 1, 1, 512) == (0, 300)


def test_restrict_matches_the_whole():
    xp = pytest.importorskip("array_api_compat.numpy")
    full = (masks.key_ranges(np.array([3, 9]), np.array([20, 14]))
            & masks.query_ranges(np.array([0, 4]), np.array([11, 12]))
            & masks.sequence_window(2, 1, query_lengths=np.array([12, 5]),
                                    key_lengths=np.array([20, 16]))).bind(xp, (2,), 1, 12, 20)
    whole = np.broadcast_to(full.tile(xp, 0, 12, 0, 20, 12, 20), (2, 1, 12, 20))
    for q0, q1, k0, k1 in ((0, 12, 0, 20), (3, 9, 5, 17), (10, 12, 0, 4)):
        part = full.restrict(xp, q0, q1, k0, k1, 12, 20)
        tile = part.tile(xp, 0, q1 - q0, 0, k1 - k0, q1 - q0, k1 - k0)
        np.testing.assert_array_equal(np.broadcast_to(tile, (2, 1, q1 - q0, k1 - k0)),
                                      whole[..., q0:q1, k0:k1])


def test_masks_travel_with_their_arrays():
    m = masks.key_ranges(np.array([1]), np.array([2])) & masks.sequence_causal(
        np.array([1]), np.array([2]))
    moved = m.with_arrays([a + 0 for a in m.arrays])
    assert moved.structure() == m.structure()
    assert len(moved.arrays) == len(m.arrays)


@pytest.mark.parametrize(("mask", "error", "text"), [
    (lambda: masks.key_ranges(np.array([0.5]), np.array([3])), TypeError,
     "key_ranges start must have an integer dtype; got key_ranges start.dtype=float64"),
    (lambda: masks.key_ranges(np.array([0, 1]), np.array([3])), ValueError,
     "key_ranges start must have shape (1,); got key_ranges start.shape=(2,)"),
    (lambda: masks.key_ranges(np.array([0]), np.array([9])), ValueError,
     "key_ranges stop must lie in [0, Lk=8]; got key_ranges stop with min=9, max=9"),
    (lambda: masks.query_ranges(np.array([-1]), np.array([2])), ValueError,
     "query_ranges start must lie in [0, Lq=4]"),
    (lambda: masks.sequence_causal(np.array([5]), np.array([3])), ValueError,
     "sequence_window query_lengths must lie in [0, Lq=4]; got"),
    (lambda: masks.key_ranges([0.5], np.array([3])), TypeError, "got start of type list"),
    (lambda: masks.sequence_window(-1, 0, query_lengths=np.array([1]),
                                   key_lengths=np.array([1])), ValueError, "left=-1"),
])
def test_bad_ranges_name_the_argument(mask, error, text):
    q, k, v = np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 8, 2)), np.zeros((1, 1, 8, 2))
    with pytest.raises(error) as info:
        portattn.attention(q, k, v, mask=mask())
    assert text in str(info.value)


def test_kernels_without_the_kinds_refuse_them():
    from portattn._inputs import describe
    from portattn.kernel import ANY, Kernel

    class Bands(Kernel):
        name = "bands"
        namespaces = devices = ANY
        dtypes = frozenset({"float32"})
        masks = frozenset({"causal", "sliding_window"})

    q = np.zeros((1, 1, 4, 8), dtype=np.float32)
    mask = masks.causal() & masks.key_ranges(np.array([1]), np.array([3]))
    assert Bands.not_supported_reasons(describe(q, q, q, mask=mask)) == [
        "mask key_ranges not supported"]
    assert portattn.explain(q, q, q, mask=mask).kernel is not None
