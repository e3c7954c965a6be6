"""Non-finite inputs, on every kernel of every backend.

The contract (README, "Non-finite inputs"):

- masked positions never reach the result: NaN or inf in padded key/value rows, in
  keys/values a causal or window mask hides, or in padded query rows, changes nothing;
- a row that does attend a non-finite value, has a NaN query, or whose scores overflow
  gets a non-finite output (NaN), never a finite number.

``KNOWN`` lists the kernels that do not honour this yet, as strict expected failures:
each one turns into an error as soon as the kernel is fixed, so the list stays true.
"""

from __future__ import annotations

import numpy as np
import pytest
from fuzz_oracle import attention64

import portattn
from portattn import masks
from portattn.errors import KernelNotUsableError
from portattn.kernel import ANY

CASES = ("nan_padded_value", "nan_padded_key", "inf_future_value", "nan_padded_query",
         "nan_query_row", "overflowing_scores")

_PRODUCT = "0 * NaN in the weights-times-values product"
KNOWN = {
    ("nan_padded_value", "torch_sdpa"): _PRODUCT,
    ("nan_padded_value", "torch_sdpa_dlpack"): _PRODUCT,
    ("nan_padded_key", "torch_sdpa"): "SDPA adds -inf to a NaN score",
    ("nan_padded_key", "torch_sdpa_dlpack"): "SDPA adds -inf to a NaN score",
    **{("inf_future_value", k): _PRODUCT for k in ("torch_sdpa", "torch_sdpa_dlpack")},
    ("inf_future_value", "example_einsum"): "the README's minimal plugin leaves it out",
    ("nan_query_row", "torch_sdpa"): "SDPA's CPU kernel gives 0 for a NaN row",
    ("nan_query_row", "torch_sdpa_dlpack"): "SDPA's CPU kernel gives 0 for a NaN row",
    ("overflowing_scores", "torch_sdpa"): "SDPA's CPU kernel gives 0 for a NaN row",
    ("overflowing_scores", "torch_sdpa_dlpack"): "SDPA's CPU kernel gives 0 for a NaN row",
}


def _case(name):
    """``(q, k, v, mask parts, rows that must be NaN, the finite inputs for the oracle)``."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 6, 8)) for _ in range(3))
    clean = (q.copy(), k.copy(), v.copy())
    nan_rows = np.zeros(6, dtype=bool)
    parts = []
    if name == "nan_padded_value":
        v[..., 4:, :] = np.nan
        parts = [("key_lengths", 4)]
    elif name == "nan_padded_key":
        k[..., 4:, :] = np.nan
        parts = [("key_lengths", 4)]
    elif name == "inf_future_value":
        v[..., 5, :] = np.inf
        parts = [("causal",)]
        nan_rows[5] = True  # the last query attends it
    elif name == "nan_padded_query":
        q[..., 3:, :] = np.nan
        parts = [("query_lengths", 3)]
    elif name == "nan_query_row":
        q[..., 2, :] = np.nan
        nan_rows[2] = True
    elif name == "overflowing_scores":
        q, k = q * 1e30, k * 1e30
        nan_rows[:] = True
    return q, k, v, parts, nan_rows, clean


def _mask(parts, backend):
    built = []
    for kind, *args in parts:
        if kind == "causal":
            built.append(masks.causal())
        else:
            built.append(getattr(masks, kind)(backend.asarray(np.array([args[0]]))))
    return None if not built else built[0] if len(built) == 1 else built[0] & built[1]


def _allowed(parts):
    allowed = np.ones((1, 2, 6, 6), dtype=bool)
    for kind, *args in parts:
        i, j = np.arange(6)[:, None], np.arange(6)[None, :]
        allowed &= {"causal": j <= i, "key_lengths": j < (args[0] if args else 0),
                    "query_lengths": i < (args[0] if args else 0)}[kind]
    return allowed


def _kernels(backend):
    return [e.name for e in portattn.kernels() if e.kernel is not None and (
        e.kernel.namespaces == ANY or backend.namespace in e.kernel.namespaces)]


@pytest.mark.parametrize("case", CASES)
def test_nonfinite_inputs(case, backend):
    q, k, v, parts, nan_rows, clean = _case(case)
    allowed = _allowed(parts)
    want, _ = attention64(*clean, allowed, None, None, None)
    problems = []
    for name in _kernels(backend):
        args = tuple(backend.asarray(a, "float32") for a in (q, k, v))
        try:
            with np.errstate(all="ignore"):  # NumPy-based kernels warn about NaN, by design
                out = portattn.attention(*args, mask=_mask(parts, backend), kernel=name)
                got = np.asarray(backend.to_numpy(out), dtype=np.float64)
        except KernelNotUsableError:
            continue
        wrong = []
        if np.isfinite(got[..., nan_rows, :]).any():
            wrong.append("a finite output where a non-finite input is attended")
        ok_rows = ~nan_rows
        if not np.isfinite(got[..., ok_rows, :]).all():
            wrong.append("a masked non-finite input leaked into the output")
        elif not np.allclose(got[..., ok_rows, :], want[..., ok_rows, :], rtol=2e-5, atol=2e-5):
            wrong.append("output differs from the oracle on the clean rows")
        known = (case, name) in KNOWN
        if bool(wrong) != known:
            problems.append(f"{name}: {'; '.join(wrong)}" if wrong else
                            f"{name} is listed in KNOWN ({KNOWN[case, name]}) but now passes:"
                            " remove it from the list")
    assert not problems, "\n".join(problems)


GRAD_KNOWN = {"torch_sdpa": _PRODUCT}


def test_masked_nonfinite_values_do_not_reach_the_gradients(backend):
    if backend.namespace != "torch":
        pytest.skip(f"{backend.name}: gradients are checked through torch")
    import torch

    q, k, v, parts, _, _ = _case("nan_padded_value")
    problems = []
    for e in portattn.kernels():
        if e.kernel is None or not e.kernel.grad:
            continue
        leaves = [torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in (q, k, v)]
        try:
            out = portattn.attention(*leaves, mask=_mask(parts, backend), kernel=e.name)
        except KernelNotUsableError:
            continue
        grads = torch.autograd.grad(out.sum(), leaves)
        finite = all(bool(torch.isfinite(g[..., :4, :]).all()) for g in grads)
        if finite == (e.name in GRAD_KNOWN):
            problems.append(f"{e.name}: " + ("a masked NaN value reached the gradients"
                                             if not finite else "fixed: remove from GRAD_KNOWN"))
    assert not problems, "\n".join(problems)
