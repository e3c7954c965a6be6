"""One-command GPU check: conformance on CUDA, and triton_flash against torch's SDPA.

    python bench/gpu_check.py            # everything, a few minutes on one GPU
    python bench/gpu_check.py --quick    # conformance on a sample of cases only
    python bench/gpu_check.py --sweep    # also time other block sizes for triton_flash

1. Conformance: every installed kernel that runs on CUDA, through the conformance kit
   (``portattn.testing``) on the ``torch_cuda`` backend and on ``cupy`` when present,
   bfloat16 included. A float32 case that misses the float32 tolerance but meets the
   TF32 one is reported as ``tf32`` (the kernel's matmuls ran in TF32), not as a pass.
2. Gradients: ``triton_flash``'s backward (through torch autograd, of the output and
   the lse) against the float64 ``reference`` kernel's autograd on CUDA, for a few
   mask/shape cases in bfloat16, float16 and float32 (``tf32`` as above).
3. Speed: ``triton_flash`` against ``torch.nn.functional.scaled_dot_product_attention``
   restricted to its flash backend, at (4, 16, 4096, 128) bfloat16, causal and not:
   TFLOP/s, the ratio, and peak memory beyond the inputs, forward alone and forward +
   backward; then the extra memory at two sequence lengths, which grows linearly for
   an O(L) kernel.

Exit status: 0 when every check passed, 1 when one failed, 2 when there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

BENCH_SHAPE = (4, 16, 4096, 128)
#: (rtol, atol) for float32 results computed with TF32 matmuls (10-bit mantissa).
TF32_TOLERANCE = (5e-3, 5e-3)
QUICK_CASES = {"basic", "causal_bottom_right", "grouped_query", "key_lengths", "softcap",
               "head_dim_256", "value_head_dim", "window_and_lengths"}


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs of ``Q K^T`` and ``P V`` (the convention flash-attention reports):
    ``4 B H Lq Lk D``, halved under a causal mask."""
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    return flops / 2 if causal else flops


@contextlib.contextmanager
def float32_tolerance(tol: tuple[float, float]) -> Iterator[None]:
    """Temporarily compare float32 results with ``tol`` in the conformance kit."""
    import importlib

    oracle = importlib.import_module("portattn.testing.oracle")  # the module, not the function
    saved = oracle.TOLERANCES["float32"]
    oracle.TOLERANCES["float32"] = tol
    try:
        yield
    finally:
        oracle.TOLERANCES["float32"] = saved


def check_one(kernel: Any, case: Any, backend: Any) -> tuple[str, str]:
    """``(status, detail)``: status is ``ok``, ``tf32``, ``skip`` or ``FAIL``."""
    import pytest

    from portattn.testing import check_case

    try:
        check_case(kernel, case, backend)
    except pytest.skip.Exception as e:
        return "skip", str(e)
    except (AssertionError, pytest.fail.Exception) as e:
        if case.dtype != "float32":
            return "FAIL", _first_line(e)
        try:
            with float32_tolerance(TF32_TOLERANCE):
                check_case(kernel, case, backend)
        except (AssertionError, pytest.fail.Exception, Exception) as again:
            return "FAIL", _first_line(again)
        return "tf32", "within TF32 tolerance only"
    except Exception as e:
        return "FAIL", f"{type(e).__name__}: {_first_line(e)}"
    return "ok", ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def cuda_kernels() -> list[Any]:
    """Installed, usable kernels whose declared devices include CUDA."""
    from portattn import kernels
    from portattn.kernel import ANY

    found = []
    for entry in kernels():
        k = entry.kernel
        if k is None or k.available() is not None:
            continue
        if k.devices == ANY or "cuda" in k.devices:
            found.append(k)
    return found


def cuda_backends() -> list[Any]:
    from portattn.testing import get_backend

    found = []
    for name in ("torch_cuda", "cupy"):
        try:
            found.append(get_backend(name))
        except ImportError as e:
            print(f"  backend {name}: not available ({e})")
    return found


def run_conformance(quick: bool) -> int:
    from portattn.testing import conformance_cases

    failures = 0
    backends = cuda_backends()
    for kernel in cuda_kernels():
        cases = conformance_cases(kernel)
        if quick:
            cases = [c for c in cases if c.name in QUICK_CASES]
        for backend in backends:
            counts: dict[str, int] = {}
            started = time.perf_counter()
            for case in cases:
                status, detail = check_one(kernel, case, backend)
                counts[status] = counts.get(status, 0) + 1
                if status in ("FAIL", "tf32"):
                    print(f"    {status:<4} {kernel.name} [{backend.name}] {case}: {detail}")
                failures += status == "FAIL"
            summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            print(f"  {kernel.name:<20} {backend.name:<10} {summary} "
                  f"({time.perf_counter() - started:.1f}s)")
    return failures


def cuda_time(fn: Callable[[], Any], warmup: int = 3, repeats: int = 20) -> float:
    """Median seconds per call, timed with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def extra_memory(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated by one call beyond what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    del result
    return torch.cuda.max_memory_allocated() - before


def run_speed(sweep: bool) -> int:
    import torch
    from portattn_triton import flash_forward
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b, h, n, d = BENCH_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    failures = 0
    print(f"  shape (B, H, L, D) = {BENCH_SHAPE} bfloat16")
    for causal in (False, True):
        flops = attention_flops(b, h, n, n, d, causal)

        def ours(causal=causal, config=None):
            return flash_forward(q, k, v, causal="top_left" if causal else None,
                                 config=config)[0]

        def theirs(causal=causal):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return sdpa(q, k, v, is_causal=causal)

        diff = (ours().float() - theirs().float()).abs().max().item()
        t_ours, t_theirs = cuda_time(ours), cuda_time(theirs)
        m_ours, m_theirs = extra_memory(ours), extra_memory(theirs)
        ratio = t_theirs / t_ours
        label = "causal" if causal else "full"
        print(f"  {label:<6} triton_flash {flops / t_ours / 1e12:7.1f} TFLOP/s "
              f"({t_ours * 1e3:.3f} ms, peak +{m_ours / 2**20:.0f} MiB) | "
              f"sdpa flash {flops / t_theirs / 1e12:7.1f} TFLOP/s "
              f"({t_theirs * 1e3:.3f} ms, peak +{m_theirs / 2**20:.0f} MiB) | "
              f"ratio {ratio:.2f} | max |diff| {diff:.2e}")
        if not diff < 0.05:
            print(f"  FAIL {label}: triton_flash and sdpa disagree by {diff:.3g}")
            failures += 1
        if sweep:
            for config in sweep_configs():
                try:
                    t = cuda_time(lambda c=config: ours(config=c), warmup=2, repeats=10)
                except Exception as e:  # out of resources for this device
                    print(f"    {config}: {type(e).__name__}: {_first_line(e)}")
                    continue
                print(f"    {config}: {flops / t / 1e12:7.1f} TFLOP/s")
    return failures


def sweep_configs() -> list[Any]:
    """Candidates around the table's bfloat16 head-dim-128 entries (--sweep)."""
    from portattn_triton import Config

    return [Config(*c) for c in ((128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3),
                                 (128, 128, 8, 2), (128, 32, 8, 3), (128, 64, 4, 3),
                                 (64, 64, 4, 3), (64, 128, 8, 3))]


def memory_scaling() -> int:
    """Extra memory of one causal call at L and 4L: an O(L) kernel grows 4x, not 16x."""
    import torch
    from portattn_triton import flash_forward

    used = []
    for n in (4096, 16384):
        q, k, v = (torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        used.append(extra_memory(lambda q=q, k=k, v=v: flash_forward(q, k, v,
                                                                      causal="top_left")))
        del q, k, v
    growth = used[1] / used[0]
    print(f"  extra memory, causal (1, 16, L, 128): L=4096 {used[0] / 2**20:.1f} MiB, "
          f"L=16384 {used[1] / 2**20:.1f} MiB (x{growth:.1f}; O(L) gives x4)")
    if not growth < 6:
        print("  FAIL memory grows faster than O(L)")
        return 1
    return 0


def grad_cases(device: Any) -> list[tuple[str, tuple, dict]]:
    """Gradient cases: (name, (B, Hq, Hkv, Lq, Lk, D, Dv), attention keywords)."""
    import torch

    from portattn import masks

    def lengths(*n: int) -> Any:
        return torch.tensor(n, device=device)

    window = (masks.sliding_window(100, 20) & masks.key_lengths(lengths(257, 100))
              & masks.query_lengths(lengths(200, 257)))
    return [("causal_bottom_right", (2, 4, 4, 300, 500, 64, 64), {"mask": masks.causal()}),
            ("gqa_window_lengths_softcap", (2, 8, 2, 257, 257, 128, 128),
             {"mask": window, "softcap": 20.0}),
            ("top_left_value_head_dim", (1, 2, 1, 200, 130, 80, 48),
             {"mask": masks.causal("top_left")}),
            ("head_dim_256", (1, 2, 2, 160, 160, 256, 256), {"mask": masks.causal()})]


def grad_case(dims: tuple, kwargs: dict, dtype: str, device: Any = "cuda") -> tuple[str, str]:
    """``(status, detail)``: triton_flash's gradients of out and lse against the float64
    reference kernel's, max error relative to the largest reference entry (at least 1),
    within the conformance kit's tolerance for ``dtype`` (float32: or TF32's)."""
    import torch

    from portattn import attention
    from portattn.testing.oracle import tolerance

    b, hq, hkv, lq, lk, d, dv = dims
    if dtype == "float32" and max(d, dv) > 128:
        return "skip", "no float32 backward above head dim 128"
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = ((hq, lq, d), (hkv, lk, d), (hkv, lk, dv), (hq, lq, dv), (hq, lq))
    q, k, v, dout, dlse = (torch.randn(b, *s, device=device, dtype=torch.float64,
                                       generator=gen) for s in shapes)

    def grads(kernel: str, tensors: list) -> list:
        leaves = [t.detach().requires_grad_() for t in tensors]
        out, lse = attention(*leaves, return_lse=True, kernel=kernel, **kwargs)
        g_lse = torch.where(torch.isinf(lse), 0.0, dlse).to(lse.dtype)
        return list(torch.autograd.grad([out, lse], leaves, [dout.to(out.dtype), g_lse],
                                        allow_unused=True, materialize_grads=True))

    want = grads("reference", [q, k, v])
    got = grads("triton_flash", [t.to(getattr(torch, dtype)) for t in (q, k, v)])
    if any(torch.isnan(g).any() for g in got):
        return "FAIL", "NaN in a gradient"
    worst = max(((g.double() - w).abs().max() / w.abs().max().clamp(min=1)).item()
                for g, w in zip(got, want, strict=True))
    if worst <= tolerance(dtype)[1]:
        return "ok", f"relative error {worst:.1e}"
    if dtype == "float32" and worst <= TF32_TOLERANCE[1]:
        return "tf32", f"relative error {worst:.1e}, within TF32 tolerance only"
    return "FAIL", f"relative error {worst:.2e} > {tolerance(dtype)[1]:g}"


def run_gradients() -> int:
    failures = 0
    for dtype in ("bfloat16", "float16", "float32"):
        for name, dims, kwargs in grad_cases("cuda"):
            try:
                status, detail = grad_case(dims, kwargs, dtype)
            except Exception as e:
                status, detail = "FAIL", f"{type(e).__name__}: {_first_line(e)}"
            print(f"  {status:<4} triton_flash backward {dtype:<8} {name}: {detail}")
            failures += status == "FAIL"
    return failures


def run_training_speed() -> int:
    """Forward + backward of triton_flash against sdpa's flash backend (BENCH_SHAPE)."""
    import torch
    from portattn_triton import flash_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b, h, n, d = BENCH_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                 generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    failures = 0
    for causal in (False, True):
        flops = 3.5 * attention_flops(b, h, n, n, d, causal)  # backward = 2.5 forwards

        def ours(causal=causal):
            out = flash_attention(q, k, v, causal="top_left" if causal else None)[0]
            return torch.autograd.grad(out, (q, k, v), dout)

        def theirs(causal=causal):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = sdpa(q, k, v, is_causal=causal)
            return torch.autograd.grad(out, (q, k, v), dout)

        diff = max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(ours(), theirs(), strict=True))
        t_ours, t_theirs = cuda_time(ours), cuda_time(theirs)
        m_ours, m_theirs = extra_memory(ours), extra_memory(theirs)
        label = "causal" if causal else "full"
        print(f"  {label:<6} fwd+bwd triton_flash {flops / t_ours / 1e12:7.1f} TFLOP/s "
              f"({t_ours * 1e3:.3f} ms, peak +{m_ours / 2**20:.0f} MiB) | sdpa flash "
              f"{flops / t_theirs / 1e12:7.1f} TFLOP/s ({t_theirs * 1e3:.3f} ms, peak "
              f"+{m_theirs / 2**20:.0f} MiB) | ratio {t_theirs / t_ours:.2f} | "
              f"max |grad diff| {diff:.2e}")
        if not diff < 0.1:
            print(f"  FAIL {label}: triton_flash and sdpa gradients disagree by {diff:.3g}")
            failures += 1
    return failures


def describe_machine() -> str:
    import torch

    parts = [f"torch {torch.__version__}"]
    for name in ("triton", "cupy", "jax"):
        with contextlib.suppress(Exception):
            parts.append(f"{name} {__import__(name).__version__}")
    props = torch.cuda.get_device_properties(0)
    cap = f"sm_{props.major}{props.minor}"
    return f"{props.name} ({cap}, {props.total_memory / 2**30:.0f} GiB); " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sample of conformance cases")
    parser.add_argument("--sweep", action="store_true", help="time other block sizes too")
    parser.add_argument("--no-speed", action="store_true", help="conformance only")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; nothing to check")
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch; nothing to check")
        return 2
    started = time.perf_counter()
    print(f"gpu_check on {describe_machine()}")
    print("conformance (portattn.testing) on CUDA:")
    failures = run_conformance(args.quick)
    print("gradients: triton_flash vs the float64 reference kernel on CUDA:")
    failures += run_gradients()
    if not args.no_speed:
        print("speed: triton_flash vs torch sdpa (flash backend):")
        failures += run_speed(args.sweep)
        failures += run_training_speed()
        failures += memory_scaling()
    print(f"gpu_check: {failures} failure(s) in {time.perf_counter() - started:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
