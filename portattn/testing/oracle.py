"""The numerical oracle (reference kernel, float64 NumPy) and dtype-keyed tolerances."""

from __future__ import annotations

from typing import Any

from .._inputs import describe
from .._reference import reference_attention
from .backends import to_numpy

__all__ = ["assert_close", "oracle", "tolerance"]

#: (rtol, atol) by input dtype, for outputs and log-sum-exps of magnitude ~1.
TOLERANCES = {
    "float64": (1e-9, 1e-10),
    "float32": (2e-5, 2e-5),
    "float16": (5e-3, 5e-3),
    "bfloat16": (3e-2, 3e-2),
}


def tolerance(dtype: str) -> tuple[float, float]:
    return TOLERANCES[dtype]


def oracle(query: Any, key: Any, value: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    """``(out, lse, weights)`` of the reference kernel on float64 NumPy copies."""
    import numpy as np

    def f64(a):
        return np.asarray(to_numpy(a), dtype=np.float64)

    for name in ("bias", "alibi_slopes", "sinks"):
        if kwargs.get(name) is not None:
            kwargs[name] = f64(kwargs[name])
    kwargs.update(return_lse=True, return_weights=True)
    inputs = describe(f64(query), f64(key), f64(value), **kwargs)
    return reference_attention(inputs)


def assert_close(actual: Any, expected: Any, dtype: str, what: str = "out") -> None:
    """``actual`` (any library) equals the float64 ``expected`` within ``dtype``'s tolerance;
    infinities (an lse of ``-inf``) must match exactly and NaN never appears."""
    import numpy as np

    got = np.asarray(to_numpy(actual), dtype=np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert not np.isnan(got).any(), f"{what}: NaN in the result"
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol,
                               err_msg=f"{what} differs from the float64 reference ({dtype})")
