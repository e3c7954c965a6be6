"""How portattn's masks reach SDPA, and fully masked rows on every SDPA backend."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from portattn_torch._sdpa_kernel import sdpa_attention  # noqa: E402
from portattn_torch._translate import sdpa_mask  # noqa: E402

import portattn  # noqa: E402
from portattn import masks  # noqa: E402
from portattn.kernel import describe  # noqa: E402
from portattn.testing import assert_close, oracle  # noqa: E402

F = torch.nn.functional
SDPA = F.scaled_dot_product_attention


def _reference(q, k, v, **kwargs):
    """float64 ``(out, lse)`` of the reference kernel, as NumPy arrays."""
    with torch.no_grad():
        out, lse = portattn.attention(q, k, v, kernel="reference", return_lse=True, **kwargs)
    return out.numpy(), lse.numpy()


def _qkv(lq=20, lk=20, hq=4, hkv=4, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, hq, lq, d, generator=g, dtype=dtype),
            torch.randn(2, hkv, lk, d, generator=g, dtype=dtype),
            torch.randn(2, hkv, lk, d, generator=g, dtype=dtype))


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Records the arguments of every SDPA call the kernel makes."""
    calls = []

    def spy(q, k, v, **kwargs):
        calls.append({"query": q, "key": k, "value": v, **kwargs})
        return SDPA(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def _run(sdpa_calls, q, k, v, **kwargs):
    out = portattn.attention(q, k, v, kernel="torch_sdpa", **kwargs)
    assert len(sdpa_calls) == 1
    assert_close(out, _reference(q, k, v, **kwargs)[0], "float64")
    return sdpa_calls[0]


def test_no_mask_passes_nothing(sdpa_calls):
    call = _run(sdpa_calls, *_qkv())
    assert call.get("attn_mask") is None
    assert call.get("is_causal", False) is False


@pytest.mark.parametrize(("alignment", "lq", "lk"), [
    ("top_left", 20, 20), ("top_left", 17, 30), ("top_left", 30, 17),
    ("bottom_right", 20, 20)])
def test_causal_uses_is_causal(sdpa_calls, alignment, lq, lk):
    call = _run(sdpa_calls, *_qkv(lq, lk), mask=masks.causal(alignment))
    assert call["attn_mask"] is None
    assert call["is_causal"] is True


def test_window_without_left_bound_is_causal(sdpa_calls):
    call = _run(sdpa_calls, *_qkv(), mask=masks.sliding_window(None, 0))
    assert call["is_causal"] is True


@pytest.mark.parametrize("mask", [None, masks.causal("top_left")], ids=["none", "causal"])
def test_few_keys_on_cpu_get_a_mask_tensor(sdpa_calls, mask):
    # Without one, torch's CPU kernel gives 0 for a NaN query's row below 16 keys.
    q, k, v = _qkv(5, 15)
    q[1, 2, 3] = math.nan
    out = sdpa_attention(describe(q, k, v, mask=mask))  # the kernel, without dispatch
    call = sdpa_calls[0]
    assert call["attn_mask"].dtype == torch.bool
    assert call["is_causal"] is False
    assert out[1, 2, 3].isnan().all()
    assert out.isnan().sum() == out.shape[-1]
    # the reference's NaN row in the same place, and its numbers everywhere else
    np.testing.assert_allclose(out.numpy(), _reference(q, k, v, mask=mask)[0], rtol=1e-9,
                               atol=1e-10)


@pytest.mark.parametrize("mask", ["none", "causal", "key_lengths"])
@pytest.mark.parametrize("lk", [16, 40])
def test_bfloat16_scores_that_overflow_give_nan_rows(sdpa_calls, mask, lk):
    # torch's CPU kernel gives 0 there; summed in float32, the scores overflow to inf.
    mask = {"none": None, "causal": masks.causal(),
            "key_lengths": masks.key_lengths(torch.tensor([7, lk]))}[mask]
    q, k, v = _qkv(5, lk, dtype=torch.bfloat16)
    q[0, 1, 2] = 1e30
    k[0, 1] = (k[0, 1].abs() + 0.5) * 1e30  # row (0, 1, 2) meets +inf scores
    out = sdpa_attention(describe(q, k, v, mask=mask))
    assert out[0, 1, 2].isnan().all()
    assert sdpa_calls[0]["query"].dtype == torch.float32
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("big", ["none", "bias"])
def test_bfloat16_calls_run_in_float32_only_when_scores_may_overflow(sdpa_calls, big):
    q, k, v = _qkv(5, 20, dtype=torch.bfloat16)
    q, k = q * 1e18, k * 1e18  # scores up to about 1e37: still in range
    bias = torch.zeros(5, 20)
    if big == "bias":
        bias[2, 3] = 3.4e38  # finite, but a score plus it may overflow
    sdpa_attention(describe(q, k, v, bias=bias))
    assert sdpa_calls[0]["query"].dtype == (torch.float32 if big == "bias"
                                            else torch.bfloat16)


def test_the_bfloat16_bound_reads_no_autograd_record():
    # (reading a tensor that requires grad as a number warns)
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=torch.bfloat16))
    portattn.attention(q, k, v, kernel="torch_sdpa").sum().backward()
    assert q.grad is not None


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_the_bfloat16_bound_is_left_out_under_torch_compile():
    # No value can be read while tracing: the call must still trace as one graph.
    q, k, v = _qkv(dtype=torch.bfloat16)
    portattn.kernels()
    compiled = torch.compile(lambda q, k, v: portattn.attention(q, k, v, kernel="torch_sdpa"),
                             backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), SDPA(q, k, v))


@pytest.mark.parametrize(("lq", "lk"), [(3, 9), (9, 3)])
def test_bottom_right_causal_on_cpu_is_a_boolean_mask(sdpa_calls, lq, lk):
    call = _run(sdpa_calls, *_qkv(lq, lk), mask=masks.causal("bottom_right"))
    assert call["is_causal"] is False
    assert call["attn_mask"].dtype == torch.bool
    assert tuple(call["attn_mask"].shape) == (lq, lk)  # broadcast, not expanded


def test_lower_right_bias_keeps_bottom_right_semantics():
    # Accelerators get torch's lower-right causal bias; its meaning is checked here on CPU.
    q, k, v = _qkv(4, 11)
    inputs = describe(q, k, v, mask=masks.causal())._replace(device="cuda")
    spec = sdpa_mask(inputs)
    assert type(spec.attn_mask).__name__ == "CausalBias"
    want, _, _ = oracle(q, k, v, mask=masks.causal())
    assert_close(sdpa_attention(inputs), want, "float64")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", ["query_lengths", "bias"])
def test_a_mask_broadcast_along_the_keys_is_written_out_off_the_cpu(kind, device):
    # torch's CUDA efficient kernel refuses a mask whose key dim is broadcast.
    q, k, v = _qkv(5, 7)
    options = ({"mask": masks.query_lengths(torch.tensor([5, 2]))} if kind == "query_lengths"
               else {"bias": torch.randn(2, 1, 5, 1, dtype=torch.float64)})
    inputs = describe(q, k, v, **options)._replace(device=device)
    mask = sdpa_mask(inputs).attn_mask
    if device == "cpu":
        assert mask.shape[-1] == 1  # broadcast, not expanded
    else:
        assert mask.shape[-1] == 7
        assert mask.stride(-1) == 1
    want, _ = _reference(q, k, v, **options)
    assert_close(sdpa_attention(inputs), want, "float64")


def test_grouped_query_passes_kv_uncopied(sdpa_calls):
    q, k, v = _qkv(hq=6, hkv=2)
    call = _run(sdpa_calls, q, k, v, mask=masks.causal("top_left"))
    assert call["enable_gqa"] is True
    assert call["key"].data_ptr() == k.data_ptr()
    assert call["value"].data_ptr() == v.data_ptr()
    assert call["key"].shape == k.shape


def test_lengths_become_a_broadcast_boolean_mask(sdpa_calls):
    q, k, v = _qkv(5, 7)
    lengths = torch.tensor([7, 3])
    call = _run(sdpa_calls, q, k, v, mask=masks.key_lengths(lengths))
    assert call["attn_mask"].dtype == torch.bool
    assert tuple(call["attn_mask"].shape) == (2, 1, 1, 7)


def test_bias_and_mask_become_one_float_mask(sdpa_calls):
    q, k, v = _qkv(5, 7)
    bias = torch.randn(4, 5, 7, dtype=torch.float64)
    call = _run(sdpa_calls, q, k, v, bias=bias, mask=masks.sliding_window(2, 1))
    attn_mask = call["attn_mask"]
    assert attn_mask.dtype == torch.float64
    masked = attn_mask == -math.inf
    # Exactly the pairs outside the window are -inf; the rest carry the bias.
    window = masks.sliding_window(2, 1).tile(np, 0, 5, 0, 7, 5, 7)
    assert torch.equal(masked[0, 0], torch.from_numpy(~window))
    assert torch.equal(attn_mask[0][~masked[0]], bias[~masked[0]])


# --- fully masked rows -------------------------------------------------------------

EMPTY_ROW_CASES = {
    "key_lengths_zero": {"mask": lambda: masks.key_lengths(torch.tensor([0, 4]))},
    "query_lengths": {"mask": lambda: masks.query_lengths(torch.tensor([2, 6]))},
    "bottom_right_long_queries": {"mask": lambda: masks.causal("bottom_right"), "lq": 9},
    "window_ahead": {"mask": lambda: masks.sliding_window(0, 0) & masks.causal("top_left"),
                     "lq": 9},
    "dense_empty_row": {"mask": lambda: masks.dense(torch.arange(6)[:, None] % 2 == 0)},
    "bias_minus_inf_row": {"bias": lambda: torch.where(
        torch.arange(6)[:, None] == 3, -math.inf, torch.zeros(6, 6, dtype=torch.float64))},
}


def _empty_row_inputs(name):
    spec = EMPTY_ROW_CASES[name]
    lq = spec.get("lq", 6)
    q, k, v = (x.requires_grad_() for x in _qkv(lq, 6))
    kwargs = {n: spec[n]() for n in ("mask", "bias") if n in spec}
    return (q, k, v), kwargs


def _check_empty_rows(args, kwargs):
    out = portattn.attention(*args, kernel="torch_sdpa", **kwargs)
    want, lse = _reference(*args, **kwargs)
    assert np.isneginf(lse).any(), "the case must have fully masked rows"
    assert_close(out.detach(), want, "float64")
    assert torch.equal(out.detach()[torch.from_numpy(np.isneginf(lse))],
                       torch.zeros_like(out.detach()[torch.from_numpy(np.isneginf(lse))]))
    out.sum().backward()
    for a in args:
        assert torch.isfinite(a.grad).all()


@pytest.mark.parametrize("name", sorted(EMPTY_ROW_CASES))
@pytest.mark.parametrize("sdpa_backend", ["MATH", "FLASH_ATTENTION"])
def test_fully_masked_rows_are_zero(name, sdpa_backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args, kwargs = _empty_row_inputs(name)
    with sdpa_kernel(getattr(SDPBackend, sdpa_backend)):
        _check_empty_rows(args, kwargs)


@pytest.mark.parametrize("name", sorted(EMPTY_ROW_CASES))
def test_fully_masked_rows_survive_a_backend_that_gives_nan(name, monkeypatch):
    # Some fused kernels turn a row of -inf into NaN; the kernel must never let one
    # reach SDPA. This stand-in does the textbook softmax, NaN on such rows included.
    def naive_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        assert not is_causal
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        s = q @ k.transpose(-1, -2) * scale
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else (
                s + attn_mask)
        return torch.softmax(s, dim=-1) @ v

    args, kwargs = _empty_row_inputs(name)
    monkeypatch.setattr(F, "scaled_dot_product_attention", naive_sdpa)
    _check_empty_rows(args, kwargs)
