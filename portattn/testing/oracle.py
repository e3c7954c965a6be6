"""The numerical oracle (reference kernel, float64 NumPy) and dtype-keyed tolerances."""

from __future__ import annotations

from typing import Any

from .._inputs import describe
from .._kernels import reference_attention
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
    """The tolerances a kernel's result must meet against the oracle.

    Args:
        dtype: the input dtype's name (``"float16"``, ``"bfloat16"``, ``"float32"``
            or ``"float64"``).

    Returns:
        ``(rtol, atol)``, for outputs and log-sum-exps of magnitude about 1.

    Example:
        >>> from portattn.testing import tolerance
        >>> tolerance("bfloat16")
        (0.03, 0.03)
    """
    return TOLERANCES[dtype]


def oracle(query: Any, key: Any, value: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    """The reference kernel's answer, computed on float64 NumPy copies.

    Args:
        query: ``(..., Hq, Lq, D)`` of any supported library.
        key: ``(..., Hkv, Lk, D)``.
        value: ``(..., Hkv, Lk, Dv)``.
        **kwargs: keyword arguments of :func:`portattn.attention` (``bias``,
            ``alibi_slopes`` and ``sinks`` are copied to float64 NumPy too; a mask's
            arrays must be NumPy).

    Returns:
        ``(out, lse, weights)`` as float64 NumPy arrays, all three always computed.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> from portattn.testing import oracle
        >>> q = np.random.default_rng(0).standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> out, lse, weights = oracle(q, q, q, mask=masks.causal())
        >>> out.dtype, lse.shape, weights.shape
        (dtype('float64'), (1, 2, 8), (1, 2, 8, 8))
        >>> bool(np.allclose(weights.sum(axis=-1), 1.0))
        True
    """
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
    """Assert that a result matches the oracle's within the input dtype's tolerance.

    Infinities (an lse of ``-inf``) must match exactly, and NaN must not appear.

    Args:
        actual: the result, an array of any supported library.
        expected: the float64 NumPy answer (from :func:`oracle`).
        dtype: the input dtype's name, which sets the tolerance (:func:`tolerance`).
        what: what is compared, for the message (``"out"``, ``"lse"``, ...).

    Raises:
        AssertionError: the shapes differ, a NaN appears, or the values differ.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn.testing import assert_close, oracle
        >>> q = np.random.default_rng(0).standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> out = portattn.attention(q, q, q)
        >>> assert_close(out, oracle(q, q, q)[0], "float32")
        >>> try:
        ...     assert_close(out + 1e-3, oracle(q, q, q)[0], "float32")
        ... except AssertionError:
        ...     print("too far")
        too far
    """
    import numpy as np

    got = np.asarray(to_numpy(actual), dtype=np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert not np.isnan(got).any(), f"{what}: NaN in the result"
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol,
                               err_msg=f"{what} differs from the float64 reference ({dtype})")
