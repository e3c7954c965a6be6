"""Causal-shaped masks computed along the diagonal (``_diagonal_shape``, ``_diagonal``)."""

from __future__ import annotations

import numpy as np
import pytest
from portattn_numpy import _diagonal_shape, configured

from portattn import attention, masks


@pytest.fixture
def along(results_of):
    return results_of("diagonal")


@pytest.fixture(params=[1, 2], ids=["a block per square", "groups of 2 squares"])
def group(request, tiny_tiles, dtype):
    """Squares sharing their earlier keys' blocks: tiny tiles hold 2-row squares, and
    groups of ``tile / max_block_k`` rows."""
    elements = tiny_tiles.tile_bytes // np.dtype(dtype).itemsize
    with configured(max_block_k=elements // (2 * request.param)):
        yield request.param


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("lq", "lk", "mask"), [
    (64, 64, masks.causal()),
    (37, 53, masks.causal()),                    # a partial square at the end
    (37, 53, masks.causal("top_left")),          # keys past the last row's diagonal
    (30, 30, masks.causal() & masks.sliding_window(None, 0)),
])
def test_matches_the_oracle(check, lq, lk, mask, dtype, along, group):
    check((2, 4, lq, 16), (2, 2, lk, 16), dtype=dtype, mask=mask)
    assert along
    assert all(along)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("lq", "lk", "mask"), [
    (64, 64, masks.causal()),
    (37, 53, masks.causal()),
    (37, 53, masks.causal("top_left")),
])
def test_every_allowed_pair_is_computed_once(lq, lk, mask, dtype, group, tiles, along):
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 1, n, 8)).astype(dtype) for n in (lq, lk))
    attention(q, k, k, mask=mask, kernel="numpy_fast")
    assert along
    times = np.zeros((lq, lk), int)
    for *_, q0, q1, k0, k1 in tiles:
        times[q0:q1, k0:k1] += 1
    allowed = np.broadcast_to(mask.tile(np, 0, lq, 0, lk, lq, lk), (lq, lk))
    assert (times[allowed] == 1).all()
    # beyond them, only the upper halves of the 2 x 2 diagonal squares
    assert times[~allowed].sum() <= lq // 2
    # a group's rows share blocks of their earlier keys
    assert max(q1 - q0 for *_, q0, q1, _, _ in tiles) == 2 * group


def test_softcap_and_default_sizes(check, along):
    # squares of 128 rows: two of them, then 44 rows that follow the mask in tiles
    check((1, 2, 300, 32), (1, 2, 300, 32), dv=16, mask=masks.causal(), softcap=5.0)
    assert along
    assert all(along)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_out_of_range_units_are_redone_carefully(check, dtype, along, tiny_tiles):
    # exp(scores) overflows without the row maximum subtracted
    check((2, 4, 37, 16), (2, 2, 53, 16), dv=16, dtype=dtype, seed=1, mask=masks.causal(),
           scale=400.0)
    assert along
    assert not any(along)


@pytest.mark.parametrize(("lq", "lk", "mask"), [
    (64, 64, masks.sliding_window(5, 0)),         # keys start after 0 further down
    (64, 40, masks.causal()),                      # the first rows see no key
    (40, 29, masks.causal("top_left")),            # the last rows see every key
    (64, 64, masks.causal() & masks.key_lengths(np.array([64, 30]))),
])
def test_other_shapes_use_tiles(check, lq, lk, mask, along, tiny_tiles):
    check((2, 4, lq, 16), (2, 2, lk, 16), mask=mask)
    assert not along


def test_threads_do_not_change_the_result(threads, tiny_tiles):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 4, 61, 16)).astype(np.float32) for _ in range(3))
    threads(1)
    one = attention(q, k, v, mask=masks.causal(), return_lse=True, kernel="numpy_fast")
    threads(3)
    three = attention(q, k, v, mask=masks.causal(), return_lse=True, kernel="numpy_fast")
    for a, b in zip(one, three, strict=True):
        np.testing.assert_array_equal(a, b)


def test_find_reads_the_shape_from_the_mask():
    found = _diagonal_shape.find(masks.causal(), 37, 53, np.float32, 16, 2)
    assert (found.size, found.key_shift) == (2, 16)
    np.testing.assert_array_equal(found.keep, [[1, 1], [0, 1]])  # keys by queries
    assert _diagonal_shape.find(masks.causal(), 1, 53, np.float32, 16, 2) is None  # no whole square
    assert _diagonal_shape.find(None, 37, 53, np.float32, 16, 2) is None
