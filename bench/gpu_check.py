"""One-command GPU check of triton_flash that fails loudly, with every figure as JSON.

    python bench/gpu/pack.py && bash bench/gpu/run.sh   # on a bare GPU machine, offline
    python bench/gpu_check.py --json out.json           # where portattn is installed
    python bench/gpu_check.py --device cpu --quick      # no GPU: the interpreter, torch CPU
    bash bench/gpu/run.sh WHEELS OUT --quick            # correctness and the forward speeds

0. Preflight: triton_flash is installed, available, and the kernel ``explain()``
   chooses for the calls it should win (the benchmark shape, decode).
1. Conformance: every installed kernel that runs on the device, through the
   conformance kit (``portattn.testing``) on ``torch_cuda`` and ``cupy``.
2. Gradients: triton_flash's backward against the float64 reference kernel.
3. Accuracy at size (``bench/gpu/accuracy.py``): L up to 4096 and 32768-key decode,
   band and length masks, packed documents, windows with global tokens or sinks, a
   bias, GQA, softcap, lse, bfloat16/float16/float32 (TF32-aware), on torch tensors
   and CuPy arrays, with poisoned outputs and a bitwise rerun.
4. Context parallelism (``bench/gpu/context_parallel.py``): portattn.distributed on
   CUDA tensors, 2 and 4 thread ranks and an NCCL group of one rank, forward and
   gradients against one float64 call.
5. Speed (``bench/gpu/timing.py``): against SDPA's flash, cuDNN and efficient
   backends; packed documents against FlexAttention and SDPA with a dense mask;
   forward + backward against SDPA flash; memory growth with L.

``--quick`` keeps the correctness checks (a sample of the conformance cases, every
mask path among them; gradients; accuracy on torch tensors in bfloat16 and float32)
and the forward speed table (no autotuning, fewer repeats), and leaves out packed
documents' speed, forward + backward speed and memory.

``--device cpu`` runs the same code on CPU torch tensors through Triton's interpreter
at shrunken sizes, faking nothing: only the GPU itself is left untried.

Exit status: 0 when every check passed, 1 when one failed or none ran, 2 when there
is no GPU (``--device cuda``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from report import Report

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

BENCH_SHAPE = (4, 16, 4096, 128)
#: (rtol, atol) for float32 results computed with TF32 matmuls (10-bit mantissa).
TF32_TOLERANCE = (5e-3, 5e-3)
#: Sequence lengths are divided by this on CPU (the interpreter is slow).
CPU_SCALE = 32
QUICK_CASES = {"basic", "causal_bottom_right", "grouped_query", "key_lengths", "softcap",
               "head_dim_256", "value_head_dim", "window_and_lengths",
               # masks read from tables and bit tiles, and a bias
               "documents_causal", "global_tokens_and_window", "function_per_batch_and_head",
               "union_of_documents_and_sinks", "bias_full", "bias_and_causal"}


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


def device_kernels(device: str = "cuda") -> list[Any]:
    """Installed, usable kernels whose declared devices include ``device``."""
    from portattn import kernels
    from portattn.kernel import ANY

    found = []
    for entry in kernels():
        k = entry.kernel
        if k is None or k.available() is not None:
            continue
        if k.devices == ANY or device in k.devices:
            found.append(k)
    return found


def cuda_kernels() -> list[Any]:
    return device_kernels("cuda")


def preflight(report: Report, device: str) -> bool:
    """triton_flash is installed, available, and can run the calls the check times
    (dispatch may still run another kernel, by deferral or evidence: the detail says
    which and why); False when the rest cannot run."""
    import torch

    from portattn import explain, kernels, masks

    entry = next((e for e in kernels() if e.name == "triton_flash"), None)
    if entry is None:
        report.check("preflight", "triton_flash installed", "FAIL",
                     "no kernel named triton_flash: is portattn-triton installed, with its "
                     "entry point (pip install, not a bare checkout)?")
        return False
    why = None if entry.kernel is None else entry.kernel.available()
    if entry.kernel is None or why is not None:
        report.check("preflight", "triton_flash available", "FAIL",
                     f"unavailable: {why or 'failed to load'}")
        return False
    report.check("preflight", "triton_flash available", "ok", str(entry))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, h, n, d = BENCH_SHAPE if device == "cuda" else (1, 2, 256, 64)
    calls = {
        "forward": ((b, h, n, d), (b, h, n, d), {}),
        "forward_causal": ((b, h, n, d), (b, h, n, d), {"mask": masks.causal()}),
        "decode_gqa": ((4, 32, 1, 128), (4, 8, 32768 if device == "cuda" else 1024, 128),
                       {"mask": masks.causal()}),
        "packed_documents": ((b, h, n, d), (b, h, n, d), {"mask": masks.causal() & masks.documents(
            torch.arange(n, device=device) // 100)}),
    }
    ok = True
    for name, (qs, ks, kwargs) in calls.items():
        q = torch.empty(qs, dtype=dtype, device=device)
        k = torch.empty(ks, dtype=dtype, device=device)
        plan = explain(q, k, k, **kwargs)
        chosen = None if plan.kernel is None else plan.kernel.name
        why = dict((e.name, w) for e, w in plan.candidates).get("triton_flash", ())
        refused = [w for w in why if not w.startswith("passed over: ")]
        status = "ok" if chosen is not None and not refused else "FAIL"
        ok &= status == "ok"
        detail = (f"dispatch runs {chosen}" + (f" ({plan.note})" if plan.note else "")
                  if status == "ok" else f"triton_flash refused: {'; '.join(refused)}\n{plan}")
        report.check("preflight", f"triton_flash can run: {name} {qs} {dtype}", status,
                     detail)
    return ok


def backends(device: str) -> list[Any]:
    from portattn.testing import get_backend

    found = []
    for name in (("torch_cuda", "cupy") if device == "cuda" else ("torch",)):
        try:
            found.append(get_backend(name))
        except ImportError as e:
            print(f"  backend {name}: not available ({e})")
    return found


def run_conformance(report: Report, device: str, quick: bool) -> None:
    from portattn.testing import conformance_cases

    found = backends(device)
    # On CPU only triton_flash (through the interpreter) is the subject. The kit asks
    # what a kernel cannot compute, not dispatch's preferences: small cases reach all.
    for kernel in [k for k in device_kernels(device)
                   if device == "cuda" or k.name == "triton_flash"]:
        cases = conformance_cases(kernel)
        if quick:
            cases = [c for c in cases if c.name in QUICK_CASES]
        if device != "cuda":  # the interpreter's bfloat16 dot is inexact
            cases = [c for c in cases if c.dtype != "bfloat16"]
        for backend in found:
            started = time.perf_counter()
            for case in cases:
                status, detail = check_one(kernel, case, backend)
                report.check("conformance", f"{kernel.name} [{backend.name}] {case}", status,
                             detail)
            print(f"  {kernel.name:<20} {backend.name:<10} {len(cases)} cases "
                  f"({time.perf_counter() - started:.1f}s)")


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


def sweep_configs() -> list[Any]:
    """Candidates around the table's bfloat16 head-dim-128 entries (--sweep)."""
    from portattn_triton import Config

    return [Config(*c) for c in ((128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3),
                                 (128, 128, 8, 2), (128, 32, 8, 3), (128, 64, 4, 3),
                                 (64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3, True))]


def run_sweep(report: Report) -> None:
    import timing

    variants = {f"triton_flash_{c}": {"config": c} for c in sweep_configs()}
    variants = {"triton_flash": {}, **variants}
    for name, dims, causal in timing.SHAPES[:2]:
        report.figure("sweep", **timing.time_shape(name, dims, causal, "cuda", variants, 10))


def memory_scaling(report: Report) -> None:
    """Extra memory of one causal call at L and 4L: an O(L) kernel grows 4x, not 16x;
    and of a decode step at Lk and 4 Lk."""
    import torch
    from portattn_triton import flash_forward

    for name, lengths, shape in (("forward", (4096, 16384), lambda n: ((1, 16, n, 128),) * 2),
                                 ("decode", (8192, 32768),
                                  lambda n: ((4, 32, 1, 128), (4, 8, n, 128)))):
        used = []
        for n in lengths:
            qs, ks = shape(n)
            q = torch.randn(qs, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(ks, device="cuda", dtype=torch.bfloat16)
            used.append(extra_memory(lambda q=q, k=k: flash_forward(q, k, k,
                                                                     causal="bottom_right")))
            del q, k
        growth = used[1] / max(used[0], 1)
        report.figure("memory", name=name, lengths=lengths, extra_bytes=used, growth=growth)
        detail = (f"extra memory at L={lengths[0]}: {used[0] / 2**20:.1f} MiB, "
                  f"L={lengths[1]}: {used[1] / 2**20:.1f} MiB (x{growth:.1f}; O(L) gives x4)")
        print(f"  {name}: {detail}")
        report.check("memory", f"{name} grows as O(L)", "ok" if growth < 6 else "FAIL", detail)


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
            ("head_dim_256", (1, 2, 2, 160, 160, 256, 256), {"mask": masks.causal()}),
            # bit tiles (chunks off the tile grid, sinks) and a bias, with its gradient
            ("chunks_sinks_bias", (2, 4, 2, 300, 300, 64, 64),
             {"mask": masks.causal() & (masks.chunks(48) | masks.sink_tokens(4)),
              "bias": "heads"})]


def grad_case(dims: tuple, kwargs: dict, dtype: str, device: Any = "cuda") -> tuple[str, str]:
    """``(status, detail)``: triton_flash's gradients of out and lse against the float64
    reference kernel's, max error relative to the largest reference entry (at least 1),
    within the conformance kit's tolerance for ``dtype`` (float32: or TF32's). With
    ``bias="heads"`` in ``kwargs``, a float32 ``(Hq, Lq, Lk)`` bias and its gradient
    too."""
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
    kwargs = dict(kwargs)
    biases = []
    if kwargs.pop("bias", None) == "heads":  # float32's values
        biases.append(torch.randn(hq, lq, lk, device=device, dtype=torch.float32,
                                  generator=gen).double())

    def grads(kernel: str, tensors: list) -> list:
        leaves = [t.detach().requires_grad_() for t in tensors]
        bias = leaves[3] if len(leaves) > 3 else None
        out, lse = attention(*leaves[:3], bias=bias, return_lse=True, kernel=kernel,
                             **kwargs)
        g_lse = torch.where(torch.isinf(lse), 0.0, dlse).to(lse.dtype)
        return list(torch.autograd.grad([out, lse], leaves, [dout.to(out.dtype), g_lse],
                                        allow_unused=True, materialize_grads=True))

    want = grads("reference", [q, k, v, *biases])
    got = grads("triton_flash", [*(t.to(getattr(torch, dtype)) for t in (q, k, v)),
                                 *(t.float() for t in biases)])
    if any(torch.isnan(g).any() for g in got):
        return "FAIL", "NaN in a gradient"
    worst = max(((g.double() - w).abs().max() / w.abs().max().clamp(min=1)).item()
                for g, w in zip(got, want, strict=True))
    if worst <= tolerance(dtype)[1]:
        return "ok", f"relative error {worst:.1e}"
    if dtype == "float32" and worst <= TF32_TOLERANCE[1]:
        return "tf32", f"relative error {worst:.1e}, within TF32 tolerance only"
    return "FAIL", f"relative error {worst:.2e} > {tolerance(dtype)[1]:g}"


def run_gradients(report: Report, device: str) -> None:
    for dtype in (("bfloat16", "float16", "float32") if device == "cuda"
                  else ("float16", "float32")):
        for name, dims, kwargs in grad_cases(device):
            if device != "cuda":  # shrink for the interpreter
                _, hq, hkv, lq, lk, d, dv = dims
                dims = (1, hq, hkv, max(1, lq // 8), max(1, lk // 8), d, dv)
                if "mask" in kwargs and name == "gqa_window_lengths_softcap":
                    continue  # its lengths are sized for the full case
            try:
                status, detail = grad_case(dims, kwargs, dtype, device=device)
            except Exception as e:
                status, detail = "FAIL", f"{type(e).__name__}: {_first_line(e)}"
            report.check("gradients", f"triton_flash backward {dtype} {name}", status, detail)


def run_training_speed(report: Report) -> None:
    """Forward + backward of triton_flash against sdpa's flash backend (BENCH_SHAPE)."""
    import torch
    from portattn_triton import flash_attention
    from timing import dispatched, median_time
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b, h, n, d = BENCH_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                 generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
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
        t_ours, t_theirs = median_time(ours, "cuda"), median_time(theirs, "cuda")
        m_ours, m_theirs = extra_memory(ours), extra_memory(theirs)
        label = "causal" if causal else "full"
        through = dispatched(q, k, v, causal, flops, "cuda", 20, grad=dout)
        if "seconds" in through:
            through["vs_sdpa_flash"] = through["seconds"] / t_theirs
        report.figure("training", name=label, shape=BENCH_SHAPE, flops=flops,
                      triton_flash={"seconds": t_ours, "extra_bytes": m_ours},
                      sdpa_flash={"seconds": t_theirs, "extra_bytes": m_theirs},
                      dispatched=through, ratio=t_theirs / t_ours, max_abs_grad_diff=diff)
        print(f"  {label:<6} fwd+bwd triton_flash {flops / t_ours / 1e12:7.1f} TFLOP/s "
              f"({t_ours * 1e3:.3f} ms, peak +{m_ours / 2**20:.0f} MiB) | sdpa flash "
              f"{flops / t_theirs / 1e12:7.1f} TFLOP/s ({t_theirs * 1e3:.3f} ms, peak "
              f"+{m_theirs / 2**20:.0f} MiB) | ratio {t_theirs / t_ours:.2f} | "
              f"max |grad diff| {diff:.2e}")
        report.check("training", f"gradients agree with sdpa flash: {label}",
                     "ok" if diff < 0.1 else "FAIL", f"max |grad diff| {diff:.3g}")


def describe_machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__}
    for name in ("triton", "cupy", "numpy", "portattn", "portattn_triton"):
        with contextlib.suppress(Exception):
            module = __import__(name)
            info[name] = getattr(module, "__version__", "?")
            info[f"{name}_path"] = str(Path(module.__file__).parent)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"sm_{props.major}{props.minor}",
                    memory_gib=round(props.total_memory / 2**30), sms=props.multi_processor_count)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true",
                        help="correctness (sampled conformance, accuracy on torch in two "
                        "dtypes) and the forward speeds only, no autotuning, fewer repeats")
    parser.add_argument("--sweep", action="store_true", help="time other block sizes too")
    parser.add_argument("--no-speed", action="store_true", help="correctness only")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--cases", default=None,
                        help="comma-separated accuracy case, context-parallel case and "
                        "speed shape names (all)")
    parser.add_argument("--skip", default="",
                        help="comma-separated sections not to run (e.g. conformance)")
    parser.add_argument("--scale", type=int, default=CPU_SCALE,
                        help=f"--device cpu: divide sequence lengths by this ({CPU_SCALE})")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        # Triton reads this when the kernel modules are imported: before any of them.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; nothing to check")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch; nothing to check")
        return 2
    report = Report(args.device, machine=describe_machine(args.device))
    print(f"gpu_check on {args.device}: {report.machine}")
    scale = 1 if args.device == "cuda" else args.scale
    chosen = None if args.cases is None else set(args.cases.split(","))
    if preflight(report, args.device):
        import accuracy
        import context_parallel
        import timing

        sections = [("conformance", lambda: run_conformance(report, args.device, args.quick)),
                    ("gradients", lambda: run_gradients(report, args.device)),
                    ("accuracy", lambda: accuracy.run(
                        report, args.device,
                        ["torch"] if args.quick else
                        [b.name.replace("torch_cuda", "torch") for b in backends(args.device)],
                        scale, ("bfloat16" if args.device == "cuda" else "float16", "float32")
                        if args.quick else ("bfloat16", "float16", "float32")
                        if args.device == "cuda" else ("float16", "float32"),
                        [c for c in accuracy.CASES if chosen is None or c.name in chosen],
                        tf32=not args.quick)),
                    ("context_parallel", lambda: context_parallel.run(
                        report, args.device, scale, chosen))]
        if not args.no_speed:
            sections.append(("speed", lambda: timing.run(
                report, args.device, scale, autotune=not args.quick,
                repeats=20 if args.device == "cuda" and not args.quick else 3,
                shapes=[s for s in timing.SHAPES if chosen is None or s[0] in chosen],
                documents=[s for s in timing.DOCUMENT_SHAPES
                           if not args.quick and (chosen is None or s[0] in chosen)])))
            if args.device == "cuda" and not args.quick:
                sections += [("training", lambda: run_training_speed(report)),
                             ("memory", lambda: memory_scaling(report))]
                if args.sweep:
                    sections.append(("sweep", lambda: run_sweep(report)))
        skipped = set(filter(None, args.skip.split(",")))
        for name, run in sections:
            if name in skipped:
                print(f"{name}: skipped (--skip)")
                continue
            started = time.perf_counter()
            print(f"{name}:")
            try:
                run()
            except Exception as e:  # a section that crashes is a failure, never a pass
                report.check(name, "section", "FAIL", f"{type(e).__name__}: {_first_line(e)}")
            print(f"  ({time.perf_counter() - started:.0f}s; {report.count('FAIL', name)} "
                  f"failed, {report.count('ok', name)} ok, {report.count('skip', name)} "
                  "skipped)")
            if args.json is not None:  # a run cut short still leaves what it found
                report.write(args.json)
    if args.json is not None:
        import evidence

        report.write(args.json)
        found = args.json.with_name(f"evidence-{args.json.name}")
        found.write_text(json.dumps(evidence.evidence([str(args.json)]), indent=1) + "\n")
        print(f"gpu_check: figures in {args.json}, what they say to dispatch in {found}")
    print(f"gpu_check: {report.summary()}; {report.failures} failure(s) "
          f"in {time.time() - report.started:.0f}s")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
