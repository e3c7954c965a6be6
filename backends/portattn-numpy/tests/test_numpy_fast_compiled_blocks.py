"""The fast way's unmasked blocks and last step, compiled, with NumPy's own BLAS
called by address: the products, weights and sums they give, what they refuse, and
the calls that use them."""

from __future__ import annotations

import ctypes.util

import numpy as np
import pytest
from portattn_numpy import _cblas, _scores, _units, configured

from portattn import masks

pytest.importorskip("numba", reason="the compiled blocks need Numba (portattn-numpy[jit])")

from portattn_numpy._compiled_blocks import compiled_blocks

DTYPES = [np.float32, np.float64]


def _ilp64_wheel() -> bool:
    """NumPy's wheels: OpenBLAS with 64-bit integers, bundled as scipy-openblas64."""
    config = getattr(np.__config__, "CONFIG", {})  # NumPy built with meson
    blas = config.get("Build Dependencies", {}).get("blas", {})
    return blas.get("name") == "scipy-openblas" and "USE64BITINT" in str(
        blas.get("openblas configuration", ""))


def _loops(dtype):
    found = compiled_blocks(dtype)
    if found is None:
        pytest.skip("this NumPy's BLAS has no cblas_?gemm named for 64-bit integers")
    return found


@pytest.mark.skipif(not _ilp64_wheel(), reason="NumPy's BLAS is not its wheels' OpenBLAS")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gemm_of_numpys_wheels_is_found(dtype):
    assert _cblas.gemm_address(np.dtype(dtype))


def test_a_library_without_those_names_gives_none(monkeypatch):
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no C library to look into")
    monkeypatch.setattr(_cblas, "blas_library_paths", lambda: [libc, "/no/such/lib.so"])
    _cblas._address.cache_clear()
    try:
        assert _cblas.gemm_address(np.dtype(np.float32)) is None
        assert _cblas.gemm_address(np.dtype(np.float64)) is None
        assert _cblas.gemm_address(np.dtype(np.float16)) is None
    finally:
        _cblas._address.cache_clear()


def _weights(k, q, alpha):
    """The float64 weights of keys by queries: 2 to the scaled scores."""
    return np.exp2(alpha * (k.astype(np.float64) @ q.astype(np.float64).T))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("first_writes", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_blocks_add_weights_times_values_and_their_sums(dtype, first_writes, masked):
    loops = _loops(dtype)
    rng = np.random.default_rng(0)
    rows, d, dv, keys = 37, 24, 8, 300
    alpha = 0.3
    q = rng.standard_normal((rows, d + 5)).astype(dtype)[:, :d]  # rows apart: ld > d
    k = rng.standard_normal((keys, d + 3)).astype(dtype)[:, :d]
    v = rng.standard_normal((keys, dv)).astype(dtype)
    table = rng.standard_normal((rows, dv + 1)).astype(dtype)  # values, then the sums
    before = table.copy()
    # a first block of every row, then one of some rows, a third of one row; masked:
    # two runs of the first block's keys (one with a row that sees none of them), and
    # the whole second block, each hiding about half its entries
    blocks = [(0, 130, 0, rows, []), (130, 290, 5, 30, []), (290, 300, 36, 37, [])]
    if masked:
        blocks[0][4].extend([(10, 3, rng.random((20, 40)) < 0.5),
                             (100, 0, rng.random((rows, 30)) < 0.5)])
        blocks[0][4][0][2][7] = True
        blocks[1][4].append((0, 0, rng.random((25, 160)) < 0.5))
    tile = _scores.ScoreTile("test.scores", 160, rows, dtype)
    span, stride = tile.span(rows, 160)  # queries by keys
    loops.accumulate(alpha, q, k, v, table[:, :-1], table[:, -1], span, stride,
                     *_units.pack(blocks), first_writes=first_writes)
    want = np.zeros((rows, dv + 1)) if first_writes else before.astype(np.float64)
    for k0, k1, r0, r1, hides in blocks:
        w = _weights(k[k0:k1], q[r0:r1], alpha)  # keys by rows
        for key, row, hidden in hides:
            w[key:key + hidden.shape[1], row:row + len(hidden)][hidden.T] = 0
        want[r0:r1, :-1] += w.T @ v[k0:k1]
        want[r0:r1, -1] += w.sum(axis=0)
    np.testing.assert_allclose(table, want, rtol=50 * np.finfo(dtype).eps,
                               atol=50 * np.finfo(dtype).eps * np.abs(want).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lse", [True, False])
def test_a_trusted_unit_is_divided_and_its_log_sums_written(dtype, lse):
    loops = _loops(dtype)
    rng = np.random.default_rng(1)
    acc = rng.standard_normal((9, 6)).astype(dtype)
    sums = rng.uniform(0.5, 3, 9).astype(dtype)
    out = np.full((9, 6), 7, dtype)
    logs = np.full(9, 7, dtype) if lse else np.empty(0, dtype)
    assert loops.finish(acc, sums, 0.5, out, logs)
    np.testing.assert_array_equal(out, acc / sums[:, None])  # exactly NumPy's division
    if lse:
        np.testing.assert_allclose(logs, np.log(sums), rtol=np.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_diagonals_accumulator_with_its_sums_beside_is_read_in_place(dtype):
    loops = _loops(dtype)
    table = np.arange(1, 4 * 6 + 1, dtype=dtype).reshape(4, 6)
    out = np.zeros((4, 5), dtype)
    assert loops.finish(table, table[:, -1], 1.0, out, np.empty(0, dtype))  # 5 of 6 columns
    np.testing.assert_array_equal(out, table[:, :-1] / table[:, -1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spoil", [
    pytest.param(lambda acc, sums: acc.__setitem__((3, 2), np.nan), id="nan-entry"),
    pytest.param(lambda acc, sums: acc.__setitem__((8, 5), np.inf), id="inf-entry"),
    pytest.param(lambda acc, sums: sums.__setitem__(0, np.nan), id="nan-sum"),
    pytest.param(lambda acc, sums: sums.__setitem__(4, np.inf), id="inf-sum"),
    pytest.param(lambda acc, sums: sums.__setitem__(8, 0.25), id="sum-below-least"),
])
def test_an_untrusted_unit_writes_nothing(dtype, spoil):
    loops = _loops(dtype)
    acc = np.ones((9, 6), dtype)
    sums = np.ones(9, dtype)
    spoil(acc, sums)
    out, logs = np.full((9, 6), 7, dtype), np.full(9, 7, dtype)
    assert not loops.finish(acc, sums, 0.5, out, logs)
    assert (out == 7).all()
    assert (logs == 7).all()


@pytest.fixture
def compiled_calls(monkeypatch):
    """How many times the calls since ran blocks compiled, and the last step compiled."""
    from portattn_numpy import _compiled_blocks

    seen = {"blocks": 0, "finish": 0}
    accumulate, finish = _compiled_blocks.CompiledBlocks.accumulate, _compiled_blocks._FINISH

    def counted(self, *args, **kwargs):
        seen["blocks"] += 1
        return accumulate(self, *args, **kwargs)

    class Finish(dict):
        def __getitem__(self, dtype):
            seen["finish"] += 1
            return finish[dtype]

    monkeypatch.setattr(_compiled_blocks.CompiledBlocks, "accumulate", counted)
    monkeypatch.setattr(_compiled_blocks, "_FINISH", Finish())
    _loops(np.float32)
    return seen


#: A dense mask that hides a few keys from the first rows: the other blocks have none.
_HOLES = np.ones((300, 2500), bool)
_HOLES[:40, 100:130] = False

CALLS = {  # (query shape, key shape, keyword arguments, strategy): each compiled path
    "tiles": ((1, 4, 700, 32), (1, 2, 900, 32), {}, "tiles"),  # grouped queries
    "diagonal": ((1, 2, 600, 16), (1, 2, 600, 16), {"mask": masks.causal()}, "diagonal"),
    "masked-blocks": ((1, 2, 300, 16), (1, 2, 2500, 16), {"mask": masks.dense(_HOLES)},
                      "tiles"),
    "key-lengths": ((2, 2, 300, 16), (2, 2, 500, 16),
                    {"mask": masks.key_lengths(np.array([500, 123]))}, "tiles"),
}


@pytest.mark.parametrize("case", list(CALLS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_calls_through_the_compiled_blocks_give_the_oracle_answer(case, dtype, check,
                                                                  compiled_calls, results_of):
    q_shape, k_shape, kwargs, strategy = CALLS[case]
    with configured(exponential="exp2_compiled", strategies=(strategy,)):
        check(q_shape, k_shape, dtype=dtype, **kwargs)
    assert compiled_calls["blocks"]
    assert compiled_calls["finish"]
    assert results_of(strategy)
    assert all(results_of(strategy))


def test_switched_off_or_with_numpys_exponential_no_compiled_block_runs(check,
                                                                       compiled_calls):
    with configured(compiled_blocks=False):
        check((1, 2, 600, 16), (1, 2, 700, 16), dtype="float32")
    with configured(exponential="exp2"):
        check((1, 2, 600, 16), (1, 2, 700, 16), dtype="float32", mask=masks.causal())
    assert compiled_calls == {"blocks": 0, "finish": 0}


@pytest.mark.parametrize("layout", [
    pytest.param(lambda q: q.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3),
                 id="heads-inside-rows"),  # rows apart, read in place
    pytest.param(lambda q: np.repeat(q, 2, axis=-1)[..., ::2], id="every-other-entry"),
])
def test_queries_are_read_in_place_or_copied_first(layout, compiled_calls):
    from portattn import attention
    from portattn.testing import assert_close, oracle

    rng = np.random.default_rng(3)
    q = layout(rng.standard_normal((1, 2, 500, 16)).astype(np.float32))
    k, v = (rng.standard_normal((1, 2, 400, 16)).astype(np.float32) for _ in range(2))
    with configured(exponential="exp2_compiled", strategies=("tiles",)):
        out = attention(q, k, v, kernel="numpy_fast")
    want, _, _ = oracle(*(a.astype(np.float64) for a in (q, k, v)))
    assert_close(out, want, "float32", "out")
    assert compiled_calls["blocks"]


def test_without_numpys_gemm_the_blocks_go_through_numpy(check, compiled_calls,
                                                         monkeypatch):
    monkeypatch.setattr(_cblas, "gemm_address", lambda dtype: None)
    with configured(exponential="exp2_compiled"):
        check((1, 2, 600, 16), (1, 2, 700, 16), dtype="float32")
    assert compiled_calls == {"blocks": 0, "finish": 0}


def test_an_overflowing_unit_is_redone_carefully(results_of, compiled_calls):
    from portattn import attention
    from portattn.testing import assert_close, oracle

    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 300, 16)).astype(np.float32) for _ in range(3))
    q[0, 1] *= 60  # scores of thousands: 2**x overflows
    with configured(exponential="exp2_compiled", strategies=("tiles",)):
        out = attention(q, k, v, kernel="numpy_fast")
    want, _, _ = oracle(*(a.astype(np.float64) for a in (q, k, v)))
    assert_close(out, want, "float32", "out")
    assert compiled_calls["finish"]
    assert False in results_of("tiles")
    assert True in results_of("tiles")
