"""A table of bad inputs, checked on every backend: the same exception type and a
message naming the argument and its value, raised by portattn itself.

Lazy arrays (Dask) have their lengths checked when the graph runs, so the table
computes every result. Non-finite values in the arrays are not errors; what they give
is specified (and checked) in ``test_nonfinite.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.errors import KernelNotUsableError, UnknownKernelError

PORTATTN_DIR = Path(portattn.__file__).parent


_SAME = object()


class Call:
    """Arrays of shape q (2, 4, 8, 16), k/v (2, 2, 10, 16) on one backend."""

    def __init__(self, backend):
        self.b = backend
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = (backend.asarray(rng.standard_normal(s), "float32")
                                  for s in ((2, 4, 8, 16), (2, 2, 10, 16), (2, 2, 10, 16)))

    def arr(self, shape, dtype="float32"):
        return self.b.asarray(np.ones(shape), dtype)

    def ints(self, values, dtype="int64"):
        return self.b.asarray(np.asarray(values, dtype=dtype))

    def bools(self, shape):
        return self.b.asarray(np.ones(shape, dtype=bool))

    def other(self, shape, dtype="float32"):
        """An array of another library (NumPy, or array-api-strict on NumPy)."""
        if self.b.name != "numpy":
            return np.ones(shape, dtype=dtype)
        strict = pytest.importorskip("array_api_strict")
        return strict.asarray(np.ones(shape, dtype=dtype))

    def attend(self, q=_SAME, k=_SAME, v=_SAME, **kwargs):
        return portattn.attention(self.q if q is _SAME else q, self.k if k is _SAME else k,
                                  self.v if v is _SAME else v, **kwargs)

    def sdpa(self, **kwargs):
        k, v = kwargs.pop("k", self.k), kwargs.pop("v", self.v)
        return portattn.scaled_dot_product_attention(self.q, k, v, **kwargs)


def _klen(c, values, dtype="int64"):
    return c.attend(mask=masks.key_lengths(c.ints(values, dtype)))


# (id, call on a Call, exception type, words the message must contain)
TABLE = [
    ("query not an array", lambda c: c.attend(q=[[1.0]]), TypeError,
     ["query must be an array", "list"]),
    ("key not an array", lambda c: c.attend(k=3.0), TypeError, ["key must be an array", "float"]),
    ("value is None", lambda c: c.attend(v=None), TypeError, ["value must be an array"]),
    ("integer query", lambda c: c.attend(q=c.ints(np.ones((2, 4, 8, 16)), "int32")),
     TypeError, ["query", "int32", "real floating"]),
    ("mixed dtypes", lambda c: c.attend(k=c.arr((2, 2, 10, 16), "float64")), TypeError,
     ["query.dtype=float32", "key.dtype=float64"]),
    ("rank too low", lambda c: c.attend(q=c.arr((8, 16))), ValueError,
     ["at least 3 dims", "query.shape=(8, 16)"]),
    ("ranks differ", lambda c: c.attend(k=c.arr((2, 10, 16)), v=c.arr((2, 10, 16))),
     ValueError, ["same rank", "(2, 10, 16)"]),
    ("batch differs", lambda c: c.attend(k=c.arr((3, 2, 10, 16)), v=c.arr((3, 2, 10, 16))),
     ValueError, ["batch dims", "key.shape=(3, 2, 10, 16)"]),
    ("head dims differ", lambda c: c.attend(k=c.arr((2, 2, 10, 8))), ValueError,
     ["query.shape[-1]=16", "key.shape[-1]=8"]),
    ("heads not a multiple", lambda c: c.attend(k=c.arr((2, 3, 10, 16)),
                                                v=c.arr((2, 3, 10, 16))), ValueError,
     ["query.shape[-3]=4", "key.shape[-3]=3"]),
    ("no key heads", lambda c: c.attend(k=c.arr((2, 0, 10, 16)), v=c.arr((2, 0, 10, 16))),
     ValueError, ["key.shape[-3]=0"]),
    ("key/value heads differ", lambda c: c.attend(v=c.arr((2, 1, 10, 16))), ValueError,
     ["key.shape=(2, 2, 10, 16)", "value.shape=(2, 1, 10, 16)"]),
    ("key/value lengths differ", lambda c: c.attend(v=c.arr((2, 2, 11, 16))), ValueError,
     ["key.shape=(2, 2, 10, 16)", "value.shape=(2, 2, 11, 16)"]),
    ("key from another library", lambda c: c.attend(k=c.other((2, 2, 10, 16))), TypeError,
     ["one array library", "key="]),
    ("lengths wrong shape", lambda c: _klen(c, [3, 4, 5]), ValueError,
     ["key_lengths", "lengths.shape=(3,)", "(2,)"]),
    ("lengths too long", lambda c: _klen(c, [3, 11]), ValueError,
     ["key_lengths", "Lk=10", "max=11"]),
    ("lengths negative", lambda c: _klen(c, [-1, 3]), ValueError,
     ["key_lengths", "min=-1"]),
    ("query lengths too long", lambda c: c.attend(mask=masks.query_lengths(c.ints([9, 1]))),
     ValueError, ["query_lengths", "Lq=8", "max=9"]),
    ("lengths float", lambda c: c.attend(mask=masks.key_lengths(c.arr((2,)))), TypeError,
     ["key_lengths", "integer dtype", "float32"]),
    ("lengths bool", lambda c: c.attend(mask=masks.key_lengths(c.bools((2,)))), TypeError,
     ["key_lengths", "integer dtype", "bool"]),
    ("lengths not integers", lambda c: c.attend(mask=masks.key_lengths("3, 4")), TypeError,
     ["key_lengths", "Python integers", "str"]),
    ("lengths floats in a list", lambda c: c.attend(mask=masks.key_lengths([3.0, 4.0])),
     TypeError, ["key_lengths", "Python integers", "list"]),
    ("window negative", lambda c: masks.sliding_window(-1), ValueError, ["left=-1"]),
    ("window not an int", lambda c: masks.sliding_window(2, 1.5), ValueError, ["right=1.5"]),
    ("bad alignment", lambda c: masks.causal("bottom_left"), ValueError,
     ["alignment='bottom_left'"]),
    ("dense not bool", lambda c: c.attend(mask=masks.dense(c.arr((8, 10)))), TypeError,
     ["dense", "dtype bool", "float32", "bias="]),
    ("padding mask as dense", lambda c: c.attend(mask=c.bools((2, 10))), ValueError,
     ["dense mask of shape (2, 10)", "masks.key_lengths", "masks.key_ranges"]),
    ("0/1 padding mask as dense", lambda c: c.attend(mask=c.ints(np.ones((2, 10)))),
     TypeError, ["dtype bool", "int64", "masks.key_lengths"]),
    ("dense wrong shape", lambda c: c.attend(mask=masks.dense(c.bools((8, 9)))), ValueError,
     ["dense mask of shape (8, 9)", "(2, 4, 8, 10)"]),
    ("dense too many dims", lambda c: c.attend(mask=masks.dense(c.bools((1, 2, 4, 8, 10)))),
     ValueError, ["dense mask of shape (1, 2, 4, 8, 10)"]),
    ("dense from another library",
     lambda c: c.attend(mask=masks.dense(np.ones((8, 10), bool) if c.b.name != "numpy"
                                         else c.other((8, 10), "bool"))), TypeError,
     ["dense", "query's library"]),
    ("bias wrong shape", lambda c: c.attend(bias=c.arr((3, 8, 10))), ValueError,
     ["bias of shape (3, 8, 10)", "(2, 4, 8, 10)"]),
    ("bias integer", lambda c: c.attend(bias=c.ints(np.ones((8, 10)))), TypeError,
     ["bias", "int64"]),
    ("bias from another library", lambda c: c.attend(bias=c.other((8, 10))), TypeError,
     ["bias", "query's library"]),
    ("mask a string", lambda c: c.attend(mask="causal"), TypeError, ["mask must be", "'causal'"]),
    ("scale a string", lambda c: c.attend(scale="0.5"), ValueError, ["scale='0.5'"]),
    ("scale nan", lambda c: c.attend(scale=math.nan), ValueError, ["scale=nan"]),
    ("scale inf", lambda c: c.attend(scale=-math.inf), ValueError, ["scale=-inf"]),
    ("scale a bool", lambda c: c.attend(scale=True), ValueError, ["scale=True"]),
    ("softcap zero", lambda c: c.attend(softcap=0.0), ValueError, ["softcap=0.0"]),
    ("softcap negative", lambda c: c.attend(softcap=-2), ValueError, ["softcap=-2"]),
    ("softcap a string", lambda c: c.attend(softcap="5"), ValueError, ["softcap='5'"]),
    ("dropout too large", lambda c: c.attend(dropout_p=1.5), ValueError, ["dropout_p=1.5"]),
    ("dropout negative", lambda c: c.attend(dropout_p=-0.1), ValueError, ["dropout_p=-0.1"]),
    ("return_lse a string", lambda c: c.attend(return_lse="no"), ValueError,
     ["return_lse='no'"]),
    ("return_weights an int", lambda c: c.attend(return_weights=1), ValueError,
     ["return_weights=1"]),
    ("unknown kernel", lambda c: c.attend(kernel="no_such_kernel"), UnknownKernelError,
     ["'no_such_kernel'", "installed kernels", "tiled"]),
    ("forced kernel cannot run", lambda c: c.attend(kernel="tiled", return_weights=True),
     KernelNotUsableError, ["'tiled'", "return_weights not supported"]),
    ("sdpa integer attn_mask", lambda c: c.sdpa(attn_mask=c.ints(np.ones((8, 10))),
                                                               enable_gqa=True), TypeError,
     ["attn_mask.dtype=int64"]),
    ("sdpa attn_mask not an array", lambda c: c.sdpa(attn_mask=[[True]], enable_gqa=True),
     TypeError, ["attn_mask must be an array", "list"]),
    ("sdpa heads without enable_gqa", lambda c: c.sdpa(), ValueError,
     ["query has 4 heads but key has 2", "enable_gqa=True"]),
]


@pytest.mark.parametrize(("name", "call", "error", "words"), TABLE, ids=[r[0] for r in TABLE])
def test_bad_input(name, call, error, words, backend):
    with pytest.raises(error) as info:
        backend.to_numpy(call(Call(backend)))  # lazy arrays (Dask) check when computed
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    raised_in = Path(info.traceback[-1].path)
    assert PORTATTN_DIR in raised_in.parents or any(
        p.name.startswith("portattn_") for p in raised_in.parents), \
        f"raised by {raised_in}, not by portattn or one of its plugins"


def test_table_is_large():
    assert len(TABLE) >= 30
