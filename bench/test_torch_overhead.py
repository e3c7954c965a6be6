"""What portattn costs on top of torch's own ``scaled_dot_product_attention`` (CPU).

Shapes (1, 8, N, 64) float32 for N = 64 (where per-call overhead shows) and 2048
(where it should vanish): ``F.scaled_dot_product_attention`` called directly, the same
through ``portattn.attention`` (dispatching to ``torch_sdpa``), and dispatch alone
(validating the call and choosing the kernel, no attention). portattn's benchmark
records its time over the direct call in ``extra_info`` and prints it; the target is
at most 1.15 at N = 64. Run::

    pytest bench/test_torch_overhead.py -p no:cacheprovider

Needs torch and ``portattn-torch``.
"""

from __future__ import annotations

import pytest

import portattn

torch = pytest.importorskip("torch")
pytest.importorskip("portattn_torch")

SIZES = (64, 2048)
HEADS, HEAD_DIM = 8, 64
TARGET = {64: 1.15}
IMPLS = ("direct", "portattn")  # direct first: portattn's ratio needs it
_best: dict[tuple[str, int], float] = {}


def _inputs(n: int) -> tuple:
    g = torch.Generator().manual_seed(n)
    return tuple(torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(3))


def _rounds(n: int) -> dict:
    return {"rounds": 200, "iterations": 10} if n <= 256 else {"rounds": 10, "iterations": 1}


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"N={n}")
@pytest.mark.parametrize("impl", IMPLS)
def test_overhead(benchmark, impl, n):
    q, k, v = _inputs(n)
    if impl == "direct":
        def call():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    else:
        assert portattn.explain(q, k, v).kernel.name == "torch_sdpa"

        def call():
            return portattn.attention(q, k, v)
    torch.testing.assert_close(call(), torch.nn.functional.scaled_dot_product_attention(q, k, v))
    benchmark.group = f"torch overhead N={n}"
    benchmark.extra_info.update(shape=(1, HEADS, n, HEAD_DIM), dtype="float32")
    benchmark.pedantic(call, warmup_rounds=3, **_rounds(n))
    _best[impl, n] = benchmark.stats.stats.min
    if impl == "portattn" and ("direct", n) in _best:
        ratio = _best[impl, n] / _best["direct", n]
        benchmark.extra_info["time_over_direct"] = ratio
        target = TARGET.get(n)
        note = f" (target <= {target})" if target else ""
        print(f"\nportattn.attention / F.scaled_dot_product_attention at N={n}: "
              f"{ratio:.3f}x{note}")


def test_dispatch_only(benchmark):
    """Validation and kernel choice alone: the part of the overhead portattn owns."""
    from portattn._dispatch import choose
    from portattn._inputs import describe

    q, k, v = _inputs(64)
    benchmark.group = "torch overhead N=64"
    benchmark.pedantic(lambda: choose(describe(q, k, v)), warmup_rounds=3, rounds=200,
                       iterations=10)
