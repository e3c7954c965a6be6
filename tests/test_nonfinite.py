"""Non-finite inputs, on every kernel of every backend.

The contract (README, "Non-finite inputs"):

- masked positions never reach the result: NaN or inf in padded key/value rows, in
  keys/values a causal or window mask hides, or in padded query rows, changes nothing;
- a row that does attend a non-finite value, has a NaN query, or whose scores overflow
  gets a non-finite output (NaN), never a finite number.

Kernels that declare ``finite_inputs_only`` (torch's SDPA, the README's example
plugin) are kept to the first rule by dispatch, which checks their output: forced by
name on such inputs they raise ``KernelNotUsableError``, and the dispatched call
(``kernel=None``, checked here on every backend) answers by the rule. ``KNOWN`` lists
what breaks the rule anyway, as strict expected failures: each one turns into an error
as soon as it is fixed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fuzz_oracle import attention64

import portattn
from portattn import masks
from portattn._lib import _plugins as _wiring
from portattn.errors import KernelNotUsableError, NoKernelError
from portattn.kernel import ANY

CASES = ("nan_padded_value", "nan_padded_key", "inf_future_value", "nan_padded_query",
         "nan_query_row", "nan_value_of_underflowed_weight", "overflowing_scores",
         "overflowing_scores_bfloat16")
#: The cases' dtype, where it is not float32.
DTYPES = {"overflowing_scores_bfloat16": "bfloat16"}
#: ``(case, kernel): why`` for what breaks the rule; none does now.
KNOWN: dict[tuple[str, str], str] = {}


def _case(name):
    """``(q, k, v, mask parts, rows that must be NaN, the finite inputs for the oracle)``."""
    rng = np.random.default_rng(1)
    length = 16 if name == "overflowing_scores_bfloat16" else 6
    q, k, v = (rng.standard_normal((1, 2, length, 16)) for _ in range(3))
    clean = (q.copy(), k.copy(), v.copy())
    nan_rows = np.zeros(length, dtype=bool)
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
    elif name == "nan_value_of_underflowed_weight":
        # key 1 scores about -500 against every query: its weight underflows to 0, but
        # the mask lets every row see it, so the NaN value makes every row NaN
        q[..., 0], k[..., 1, :] = 5.0, 0.0
        k[..., 1, 0] = -400.0
        clean = (q.copy(), k.copy(), v.copy())
        v[..., 1, :] = np.nan
        parts = [("key_lengths", 4)]
        nan_rows[:] = True
    elif name == "overflowing_scores":
        q, k = q * 1e30, k * 1e30
        nan_rows[:] = True
    elif name == "overflowing_scores_bfloat16":
        q, k = (np.abs(q) + 0.5) * 1e30, (np.abs(k) + 0.5) * 1e30  # every score +inf
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


def _allowed(parts, length=6):
    allowed = np.ones((1, 2, length, length), dtype=bool)
    for kind, *args in parts:
        i, j = np.arange(length)[:, None], np.arange(length)[None, :]
        allowed &= {"causal": j <= i, "key_lengths": j < (args[0] if args else 0),
                    "query_lengths": i < (args[0] if args else 0)}[kind]
    return allowed


def _kernels(backend):
    """Every kernel for the backend's library, forced by name, then the dispatched call."""
    return [e.name for e in portattn.kernels() if e.kernel is not None and (
        e.kernel.namespaces == ANY or backend.namespace in e.kernel.namespaces)] + [None]


@pytest.mark.parametrize("case", CASES)
def test_nonfinite_inputs(case, backend):
    dtype = DTYPES.get(case, "float32")
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    q, k, v, parts, nan_rows, clean = _case(case)
    allowed = _allowed(parts, q.shape[-2])
    want, _ = attention64(*clean, allowed, None, None, None)
    problems = []
    for name in _kernels(backend):
        args = tuple(backend.asarray(a, dtype) for a in (q, k, v))
        try:
            with np.errstate(all="ignore"):  # NumPy-based kernels warn about NaN, by design
                out = portattn.attention(*args, mask=_mask(parts, backend), kernel=name)
                got = np.asarray(backend.to_numpy(out), dtype=np.float64)
        except KernelNotUsableError as e:
            if name is None:
                problems.append(f"the dispatched call raised {e}")
            continue
        wrong = []
        if np.isfinite(got[..., nan_rows, :]).any():
            wrong.append("a finite output where a non-finite input is attended")
        ok_rows = ~nan_rows
        if not np.isfinite(got[..., ok_rows, :]).all():
            wrong.append("a masked non-finite input leaked into the output")
        elif not np.allclose(got[..., ok_rows, :], want[..., ok_rows, :], rtol=2e-5, atol=2e-5):
            wrong.append("output differs from the oracle on the clean rows")
        chosen = name or portattn.explain(*args, mask=_mask(parts, backend)).kernel.name
        known = (case, chosen) in KNOWN
        if bool(wrong) != known:
            problems.append(f"{name or 'dispatched'}: {'; '.join(wrong)}" if wrong else
                            f"{chosen} is listed in KNOWN ({KNOWN[case, chosen]}) but now passes:"
                            " remove it from the list")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("wiring", ["installed", "absent"])
@pytest.mark.parametrize("case", ["nan_padded_value", "nan_padded_key"])
def test_masked_nonfinite_inputs_do_not_reach_the_gradients(case, wiring, backend,
                                                            monkeypatch):
    """With the torch plugin's autograd wiring (the flash backward) and without it,
    where torch's autograd records the tiled kernel's tiles."""
    if backend.namespace != "torch":
        pytest.skip(f"{backend.name}: gradients are checked through torch")
    import torch

    if wiring == "absent":
        parts = _wiring.parts_for("torch")
        monkeypatch.setitem(_wiring._parts, "torch",
                            dataclasses.replace(parts, attach_autograd=None))

    q, k, v, parts, _, _ = _case(case)
    problems = []
    for name in [e.name for e in portattn.kernels() if e.kernel and e.kernel.grad] + [None]:
        leaves = [torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in (q, k, v)]
        try:
            with np.errstate(all="ignore"):
                out = portattn.attention(*leaves, mask=_mask(parts, backend), kernel=name)
        except KernelNotUsableError:
            continue
        grads = torch.autograd.grad(out.sum(), leaves)
        if not all(bool(torch.isfinite(g[..., :4, :]).all()) for g in grads):
            problems.append(f"{name or 'dispatched'}: a masked NaN reached the gradients")
    assert not problems, "\n".join(problems)


def test_a_kernel_exact_on_finite_inputs_only_is_refused_with_the_reason(backend):
    """Forced on a call whose output fails the check, it raises with the reason; with
    every other kernel disabled, its answer on finite inputs stands (no second kernel
    ran), and on the same call with an inf future value no kernel is left."""
    q, k, v, parts, _, clean = _case("inf_future_value")
    mask = _mask(parts, backend)
    poisoned = tuple(backend.asarray(a, "float32") for a in (q, k, v))
    finite = tuple(backend.asarray(a, "float32") for a in clean)
    finite_only = [e for e in portattn.kernels() if e.kernel is not None
                   and e.kernel.finite_inputs_only
                   and portattn.explain(*finite, mask=mask, kernel=e.name).kernel]
    if not finite_only:
        pytest.skip(f"no kernel that can run on {backend.name} declares finite_inputs_only")
    want, _ = attention64(*clean, _allowed(parts), None, None, None)
    declined = "exact on finite inputs only: its output holds NaN or inf"
    for entry in finite_only:
        with np.errstate(all="ignore"), pytest.raises(KernelNotUsableError, match=declined):
            portattn.attention(*poisoned, mask=mask, kernel=entry.name)
        others = [e.name for e in portattn.kernels() if e.name != entry.name]
        with portattn.disable_kernels(*others):
            got = backend.to_numpy(portattn.attention(*finite, mask=mask))
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
            with np.errstate(all="ignore"), pytest.raises(NoKernelError,
                                                          match=f"{entry.name}.*{declined}"):
                portattn.attention(*poisoned, mask=mask)


def test_the_callers_word_skips_the_output_check():
    from portattn._inputs import describe
    from portattn._kernels import distrust

    q = np.ones((1, 1, 3, 4), np.float32)
    mask = masks.causal()
    out = np.full((1, 1, 3, 4), np.nan, np.float32)
    assert distrust(describe(q, q, q, mask=mask), out) is not None
    assert distrust(describe(q, q, q, mask=mask, assume_finite=True), out) is None
    with pytest.raises(ValueError, match="assume_finite must be True or False; got "
                                         "assume_finite='yes'"):
        portattn.attention(q, q, q, assume_finite="yes")
