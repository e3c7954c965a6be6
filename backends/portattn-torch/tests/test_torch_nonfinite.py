"""torch_sdpa keeps the rule for non-finite inputs where nothing checks its output.

On an accelerator (simulated here on CPU tensors by a description whose device is
"cuda", so that no value is read) and under ``torch.compile``, the kernel clears
non-finite keys and values itself: a hidden one changes nothing, and the rows that
attend one are NaN, in the output and in their gradients.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from portattn_torch._nonfinite import rows_seeing  # noqa: E402
from portattn_torch._sdpa_kernel import sdpa_attention  # noqa: E402

import portattn  # noqa: E402
from portattn import masks  # noqa: E402
from portattn.kernel import describe  # noqa: E402

NAN, INF = float("nan"), float("inf")


def _qkv(lq, lk, hq=2, hkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, hq, lq, 8, generator=g), torch.randn(2, hkv, lk, 8, generator=g),
            torch.randn(2, hkv, lk, 8, generator=g))


def _bias_hiding_key_5(lq, lk, hq):
    bias = torch.randn(2, hq, lq, lk, generator=torch.Generator().manual_seed(1))
    bias[..., 1:, 5] = -INF  # key 5 is hidden from every row but row 0
    return bias


def _case(name):
    """``(q, k, v, options, the inputs made bad in place, rows that must be NaN)``;
    rows are ``(batch, heads, query rows)`` index tuples."""
    if name == "padded keys and values":
        q, k, v = _qkv(20, 20)
        options = {"mask": masks.key_lengths(torch.tensor([12, 20]))}

        def spoil(k, v):
            k[0, :, 15], v[0, :, 12:] = NAN, INF
        return q, k, v, options, spoil, []
    if name == "a future value, top-left causal":
        q, k, v = _qkv(20, 20)
        return q, k, v, {"mask": masks.causal("top_left")}, \
            lambda k, v: v[:, :, 13].fill_(NAN), [(slice(None), slice(None), slice(13, 20))]
    if name == "a future key, bottom-right causal, fewer queries":
        q, k, v = _qkv(4, 11)  # row i sees keys <= i + 7
        return q, k, v, {"mask": masks.causal()}, \
            lambda k, v: k[:, :, 9].fill_(NAN), [(slice(None), slice(None), slice(2, 4))]
    if name == "a past key, top-left causal, more queries than keys":
        q, k, v = _qkv(24, 16)  # rows 15 to 23 see every key
        return q, k, v, {"mask": masks.causal("top_left")}, \
            lambda k, v: k[:, :, 10].fill_(NAN), [(slice(None), slice(None), slice(10, 24))]
    if name == "a key a bias hides, grouped heads":
        q, k, v = _qkv(20, 20, hq=4, hkv=2)
        return q, k, v, {"bias": _bias_hiding_key_5(20, 20, 4)}, \
            lambda k, v: v[:, :, 5].fill_(NAN), [(slice(None), slice(None), 0)]
    if name == "a sliding window":
        q, k, v = _qkv(20, 20)
        return q, k, v, {"mask": masks.sliding_window(3)}, \
            lambda k, v: k[:, :, 10].fill_(INF), [(slice(None), slice(None), slice(10, 14))]
    if name == "padded queries":
        q, k, v = _qkv(20, 20)  # every real row sees key 2; the padded ones stay 0
        return q, k, v, {"mask": masks.query_lengths(torch.tensor([15, 20]))}, \
            lambda k, v: v[:, :, 2].fill_(NAN), [(0, slice(None), slice(0, 15)),
                                                 (1, slice(None), slice(None))]
    raise AssertionError(name)


CASES = ["padded keys and values", "a future value, top-left causal",
         "a future key, bottom-right causal, fewer queries",
         "a past key, top-left causal, more queries than keys",
         "a key a bias hides, grouped heads", "a sliding window", "padded queries"]


def _want(q, k, v, **options):
    """float64 answer of the reference kernel on the inputs before they were spoiled."""
    wide = {n: a.double() if n == "bias" else a for n, a in options.items()}
    with torch.no_grad():
        return portattn.attention(q.double(), k.double(), v.double(), kernel="reference",
                                  **wide).numpy()


def _as_on_a_gpu(q, k, v, **options):
    """SDPA's answer when the values cannot be read: what runs on an accelerator."""
    inputs = describe(q, k, v, **options)._replace(device="cuda")
    assert not inputs.values_readable
    return sdpa_attention(inputs)


def _nan_rows(out, rows):
    nan = torch.zeros(out.shape[:-1], dtype=torch.bool)
    for index in rows:
        nan[index] = True
    return nan


def _assert_follows_the_rule(got, want, nan):
    assert got[nan].isnan().all(), "a row that attends a non-finite input is not NaN"
    assert got[~nan].isfinite().all(), "a hidden non-finite input reached another row"
    np.testing.assert_allclose(got[~nan].detach().numpy(), want[~nan.numpy()],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_where_no_value_is_read_sdpa_follows_the_rule_itself(case):
    q, k, v, options, spoil, rows = _case(case)
    want = _want(q, k, v, **options)
    spoil(k, v)
    got = _as_on_a_gpu(q, k, v, **options)
    _assert_follows_the_rule(got, want, _nan_rows(got, rows))


# (on an accelerator a bottom-right causal mask is torch's bias, on the CPU a tensor)
@pytest.mark.parametrize("case", [c for c in CASES if "bottom-right" not in c])
def test_on_finite_inputs_the_guard_changes_no_bit(case):
    q, k, v, options, _, _ = _case(case)
    assert torch.equal(_as_on_a_gpu(q, k, v, **options),
                       sdpa_attention(describe(q, k, v, **options)))


def _gradients(q, k, v, options, spoil=None):
    q, k, v = (x.clone() for x in (q, k, v))
    if spoil is not None:
        spoil(k, v)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(_as_on_a_gpu(*leaves, **options).sum(), leaves)


def test_the_gradients_of_rows_that_see_no_bad_key_are_unchanged():
    q, k, v, options, spoil, _ = _case("a future value, top-left causal")
    dq_clean = _gradients(q, k, v, options)[0]
    dq = _gradients(q, k, v, options, spoil)[0]
    assert dq[..., 13:, :].isnan().all()  # the rows that attend the NaN value
    torch.testing.assert_close(dq[..., :13, :], dq_clean[..., :13, :], rtol=0, atol=0)


def test_padded_keys_reach_no_gradient_of_what_the_mask_lets_through():
    q, k, v, options, spoil, _ = _case("padded keys and values")
    clean = _gradients(q, k, v, options)
    for g, g_clean in zip(_gradients(q, k, v, options, spoil), clean, strict=True):
        torch.testing.assert_close(g, g_clean)  # padded keys: 0 in both


# dynamo notes that it traces through array-api-compat's lru_cache (no effect on results)
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.parametrize("case", ["padded keys and values", "a future value, top-left causal",
                                  "a past key, top-left causal, more queries than keys",
                                  "a sliding window"])
def test_under_torch_compile_sdpa_follows_the_rule(case):
    # Nothing can be read while tracing, so dispatch cannot check the output there.
    q, k, v, options, spoil, rows = _case(case)
    want = _want(q, k, v, **options)
    spoil(k, v)
    portattn.kernels()
    compiled = torch.compile(
        lambda q, k, v: portattn.attention(q, k, v, kernel="torch_sdpa", **options),
        backend="eager", fullgraph=True)
    got = compiled(q, k, v)
    _assert_follows_the_rule(got, want, _nan_rows(got, rows))


def test_rows_seeing_counts_bad_keys_per_row_for_each_mask_form():
    from torch.nn.attention.bias import causal_lower_right

    bad = torch.zeros(1, 1, 6, dtype=torch.bool)
    bad[..., 4] = True
    top_left = rows_seeing(bad, None, True, 6, 1, torch.float32)
    assert top_left[0, 0].tolist() == [False] * 4 + [True] * 2
    lower_right = rows_seeing(bad, causal_lower_right(3, 6), False, 3, 1, torch.float32)
    assert lower_right[0, 0].tolist() == [False, True, True]  # row i sees keys <= i + 3
    allowed = torch.ones(2, 6, dtype=torch.bool)
    allowed[0, 4] = False
    as_bool = rows_seeing(bad, allowed, False, 2, 1, torch.float16)
    as_float = rows_seeing(bad, torch.where(allowed, 0.0, -math.inf), False, 2, 1,
                           torch.float16)
    assert as_bool[0, 0].tolist() == as_float[0, 0].tolist() == [False, True]
    grouped = rows_seeing(torch.stack([bad[0, 0], ~bad[0, 0]])[None], allowed, False, 2, 2,
                          torch.float32)
    assert grouped.shape == (1, 4, 2)
    assert grouped[0, :, 0].tolist() == [False, False, True, True]


def test_rows_seeing_a_causal_mask_stops_at_the_last_key():
    # With more queries than keys, top-left rows past the last key see every key, and
    # no more: a row sees a bad key only if there is one.
    clean = torch.zeros(1, 1, 4, dtype=torch.bool)
    assert not rows_seeing(clean, None, True, 7, 1, torch.float32).any()
    bad = clean.clone()
    bad[..., 2] = True
    assert rows_seeing(bad, None, True, 7, 1, torch.float32)[0, 0].tolist() == \
        [False] * 2 + [True] * 5


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_under_torch_compile_finite_causal_rows_past_the_keys_stay_finite():
    q, k, v = _qkv(24, 16)
    want = _want(q, k, v, mask=masks.causal("top_left"))
    portattn.kernels()
    compiled = torch.compile(
        lambda q, k, v: portattn.scaled_dot_product_attention(q, k, v, is_causal=True),
        backend="eager", fullgraph=True)
    np.testing.assert_allclose(compiled(q, k, v).numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_mask_that_hides_nothing_costs_no_pass_over_the_keys(monkeypatch):
    # A causal decode step sees every key: the KV cache is not read twice.
    import portattn_torch._sdpa_kernel as kernel

    monkeypatch.setattr(kernel, "clear_keys", lambda *_: pytest.fail("guarded"))
    q, k, v = _qkv(1, 30)
    k[..., 3, :] = NAN
    assert _as_on_a_gpu(q, k, v, mask=masks.causal()).isnan().all()


def test_with_the_callers_word_no_guard_runs(monkeypatch):
    import portattn_torch._sdpa_kernel as kernel

    q, k, v = _qkv(6, 9)
    want = _as_on_a_gpu(q, k, v, mask=masks.key_lengths(torch.tensor([9, 4])))
    monkeypatch.setattr(kernel, "clear_keys", lambda *_: pytest.fail("guarded"))
    got = _as_on_a_gpu(q, k, v, mask=masks.key_lengths(torch.tensor([9, 4])),
                       assume_finite=True)
    assert torch.equal(got, want)  # on finite inputs the guard changed nothing anyway
