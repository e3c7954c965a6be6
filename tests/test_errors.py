"""Bad input gets a TypeError/ValueError naming the argument and the values."""

from __future__ import annotations

import math

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.testing.plugin import require_library


def arrays(q=(2, 4, 8, 16), k=(2, 4, 10, 16), v=None, dtype=np.float32):
    rng = np.random.default_rng(0)
    v = v or k
    return tuple(rng.standard_normal(s).astype(dtype) for s in (q, k, v))


Q, K, V = arrays()
# (name, call, exception type, words that the message must contain)
BAD_INPUTS = [
    ("query not an array", lambda: portattn.attention([1.0], K, V), TypeError,
     ["query must be an array", "list"]),
    ("integer dtype", lambda: portattn.attention(Q.astype(np.int32), K.astype(np.int32),
                                                 V.astype(np.int32)), TypeError,
     ["query.dtype=int32", "real floating"]),
    ("mixed dtypes", lambda: portattn.attention(Q, K.astype(np.float64), V), TypeError,
     ["query.dtype=float32", "key.dtype=float64"]),
    ("rank too low", lambda: portattn.attention(Q[0, 0], K[0, 0], V[0, 0]), ValueError,
     ["at least 3 dims", "query.shape=(8, 16)"]),
    ("ranks differ", lambda: portattn.attention(Q, K[0], V[0]), ValueError, ["same rank"]),
    ("batch differs", lambda: portattn.attention(Q, *arrays(k=(3, 4, 10, 16))[1:]),
     ValueError, ["batch dims", "key.shape=(3, 4, 10, 16)"]),
    ("head dims differ", lambda: portattn.attention(*arrays(k=(2, 4, 10, 8))), ValueError,
     ["query.shape[-1]=16", "key.shape[-1]=8"]),
    ("heads not a multiple", lambda: portattn.attention(*arrays(k=(2, 3, 10, 16))),
     ValueError, ["query.shape[-3]=4", "key.shape[-3]=3"]),
    ("key/value lengths differ",
     lambda: portattn.attention(*arrays(k=(2, 4, 10, 16), v=(2, 4, 11, 16))), ValueError,
     ["key.shape=(2, 4, 10, 16)", "value.shape=(2, 4, 11, 16)"]),
    ("lengths wrong shape", lambda: portattn.attention(
        Q, K, V, mask=masks.key_lengths(np.array([3, 4, 5]))), ValueError,
     ["lengths.shape=(3,)", "(2,)"]),
    ("lengths out of range", lambda: portattn.attention(
        Q, K, V, mask=masks.key_lengths(np.array([3, 11]))), ValueError,
     ["Lk=10", "max=11"]),
    ("negative lengths", lambda: portattn.attention(
        Q, K, V, mask=masks.query_lengths(np.array([-1, 2]))), ValueError,
     ["Lq=8", "min=-1"]),
    ("float lengths", lambda: portattn.attention(
        Q, K, V, mask=masks.key_lengths(np.array([3.0, 4.0]))), TypeError,
     ["integer dtype", "float64"]),
    ("negative window", lambda: masks.sliding_window(-1), ValueError, ["left=-1"]),
    ("bad alignment", lambda: masks.causal("bottom_left"), ValueError,
     ["alignment='bottom_left'"]),
    ("dense not bool", lambda: portattn.attention(
        Q, K, V, mask=masks.dense(np.ones((8, 10)))), TypeError, ["dtype bool"]),
    ("dense does not broadcast", lambda: portattn.attention(
        Q, K, V, mask=masks.dense(np.ones((8, 9), dtype=bool))), ValueError,
     ["(8, 9)", "(2, 4, 8, 10)"]),
    ("bias does not broadcast", lambda: portattn.attention(Q, K, V, bias=np.ones((3, 8, 10))),
     ValueError, ["bias of shape (3, 8, 10)"]),
    ("bias not float", lambda: portattn.attention(Q, K, V, bias=np.ones((8, 10), dtype=int)),
     TypeError, ["bias", "int64"]),
    ("mask not a mask", lambda: portattn.attention(Q, K, V, mask="causal"), TypeError,
     ["mask must be", "'causal'"]),
    ("string scale", lambda: portattn.attention(Q, K, V, scale="0.5"), ValueError,
     ["scale='0.5'"]),
    ("nan scale", lambda: portattn.attention(Q, K, V, scale=math.nan), ValueError,
     ["scale=nan"]),
    ("infinite scale", lambda: portattn.attention(Q, K, V, scale=math.inf), ValueError,
     ["scale=inf"]),
    ("negative softcap", lambda: portattn.attention(Q, K, V, softcap=-1.0), ValueError,
     ["softcap=-1.0"]),
    ("dropout out of range", lambda: portattn.attention(Q, K, V, dropout_p=1.5), ValueError,
     ["dropout_p=1.5"]),
    ("sdpa heads without enable_gqa", lambda: portattn.scaled_dot_product_attention(
        *arrays(k=(2, 2, 10, 16))), ValueError, ["enable_gqa=True"]),
]


@pytest.mark.parametrize(("name", "call", "error", "words"), BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_message(name, call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


def bfloat16(a):
    """``a`` as NumPy holds bfloat16: ml_dtypes' type, which ``numpy.isdtype`` refuses."""
    import ml_dtypes

    return np.asarray(a).astype(ml_dtypes.bfloat16)


# CuPy holds bfloat16 as NumPy does; such calls failed on a GPU inside isdtype with
# "dtype argument must be a NumPy dtype", naming no argument.
BFLOAT16 = [
    ("query", lambda: portattn.attention(bfloat16(Q), bfloat16(K), bfloat16(V))),
    ("key", lambda: portattn.attention(Q, bfloat16(K), V)),
    ("bias", lambda: portattn.attention(Q, K, V, bias=bfloat16(np.ones((8, 10))))),
    ("sinks", lambda: portattn.attention(Q, K, V, sinks=bfloat16(np.ones(4)))),
    ("attn_mask", lambda: portattn.scaled_dot_product_attention(
        Q, K, V, attn_mask=bfloat16(np.ones((8, 10))))),
]


@pytest.mark.parametrize(("argument", "call"), BFLOAT16, ids=[b[0] for b in BFLOAT16])
def test_a_bfloat16_the_library_does_not_know_is_refused_by_name(argument, call):
    pytest.importorskip("ml_dtypes")
    with pytest.raises(TypeError) as info:
        call()
    assert f"{argument}.dtype=bfloat16, which numpy.isdtype does not know" in str(info.value)


def test_a_bfloat16_another_library_knows_is_still_refused_on_numpy():
    # JAX's bfloat16 is the same dtype object as ml_dtypes' one NumPy holds: what JAX's
    # isdtype says of it must not be taken for NumPy's answer
    jnp = require_library("jax").numpy
    q = jnp.zeros((1, 2, 4, 8), dtype=jnp.bfloat16)
    assert portattn.attention(q, q, q).dtype == jnp.bfloat16
    with pytest.raises(TypeError, match=r"query\.dtype=bfloat16, which numpy\.isdtype"):
        portattn.attention(*(np.asarray(q) for _ in range(3)))


@pytest.mark.cross  # two libraries: runs in the cross tox env (numpy + torch)
def test_arrays_from_different_libraries():
    torch = require_library("torch")
    with pytest.raises(TypeError, match="one array library"):
        portattn.attention(Q, torch.asarray(K), V)


@pytest.mark.cross  # two libraries: runs in the cross tox env (numpy + torch)
def test_lengths_from_another_library_are_moved_to_the_query_library():
    torch = require_library("torch")
    expected = portattn.attention(Q, K, V, mask=masks.key_lengths(np.array([3, 4])))
    out = portattn.attention(Q, K, V, mask=masks.key_lengths(torch.tensor([3, 4])))
    np.testing.assert_array_equal(out, expected)
    # a dense mask holds Lq x Lk values: it must already be the query's
    with pytest.raises(TypeError, match=r"dense mask must come from the query's library"):
        portattn.attention(Q, K, V, mask=masks.dense(torch.ones(Q.shape[-2], K.shape[-2],
                                                                dtype=torch.bool)))


def test_dropout_without_a_seed_on_numpy_names_the_seed():
    with pytest.raises(ValueError, match="dropout_p > 0 on numpy arrays needs dropout_seed"):
        portattn.scaled_dot_product_attention(Q, K, V, dropout_p=0.1)
    out = portattn.scaled_dot_product_attention(Q, K, V, dropout_p=0.1, dropout_seed=4)
    assert out.shape == Q.shape


def test_dropout_refused_by_the_kernels_without_it(monkeypatch):
    from portattn._kernels import ReferenceKernel, TiledKernel

    for kernel in (ReferenceKernel, TiledKernel):
        monkeypatch.setattr(kernel, "dropout", False)
    with portattn.disable_kernels(*(e.name for e in portattn.kernels()
                                    if e.distribution != "portattn")), \
            pytest.raises(portattn.errors.NoKernelError) as info:
        portattn.attention(Q, K, V, dropout_p=0.1, dropout_seed=1)
    message = str(info.value)
    assert "dropout_p=0.1 not supported" in message
    assert "tiled (portattn" in message
    assert "query : shape=(2, 4, 8, 16) dtype=float32 namespace=numpy" in message
