"""``portattn-bench``: sweep, table, JSON and plot in one command."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import backends as _backends
from . import cases as _cases

__all__ = ["main", "parse"]

QUICK = {"sizes": _cases.QUICK_SIZES, "heads": 4, "repeat": 3, "max_time": 1.0, "budget": 1.5}
DTYPES = {"cpu": ("float32",), "cuda": ("float16", "bfloat16", "float32")}
QUICK_DTYPES = {"cpu": ("float32",), "cuda": ("float16", "float32")}
MASKS = {"none": False, "causal": True}


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        msg = f"expected a comma-separated list; got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return names


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(n) for n in _names(text))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        msg = f"expected positive integers like 512,1024; got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return tuple(sorted(set(sizes)))


def _masks(text: str) -> tuple[bool, ...]:
    names = _names(text)
    unknown = [n for n in names if n not in MASKS]
    if unknown:
        msg = f"unknown mask {', '.join(unknown)}; choose from none, causal"
        raise argparse.ArgumentTypeError(msg)
    return tuple(MASKS[n] for n in dict.fromkeys(names))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="portattn-bench",
        description="Time every installed attention kernel (two baselines and NumPy's "
                    "float32 GEMM as a reference) on this machine; print a table, write "
                    "raw results as JSON and a plot as PNG.")
    p.add_argument("--quick", action="store_true",
                   help=f"small sweep (L={','.join(map(str, QUICK['sizes']))}, "
                        f"{QUICK['heads']} heads, {QUICK['repeat']} repeats)")
    p.add_argument("--kernels", type=_names, help="kernels and baselines to time "
                   "(default: all installed kernels, numpy_textbook, torch_sdpa_direct, "
                   "numpy_sgemm)")
    p.add_argument("--backends", type=_names,
                   help="array libraries, named as in portattn.testing (default: numpy,"
                        "torch,jax,dask on cpu; torch_cuda,jax_cuda,cupy on cuda; "
                        "array_api_strict on request)")
    p.add_argument("--sizes", type=_sizes, help="sequence lengths Lq = Lk (default: "
                   f"{','.join(map(str, _cases.DEFAULT_SIZES))})")
    p.add_argument("--dtypes", type=_names, help="default: float32 on cpu; "
                   "float16,bfloat16,float32 on cuda")
    masks = p.add_mutually_exclusive_group()
    masks.add_argument("--masks", type=_masks, help="none,causal (default: both)")
    masks.add_argument("--causal", dest="masks", action="store_const", const=(True,),
                       help="causal only")
    masks.add_argument("--no-causal", dest="masks", action="store_const", const=(False,),
                       help="no mask only")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arrays live (cuda: torch_cuda, jax_cuda and cupy)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, help="default 8 (4 with --quick)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--value-head-dim", type=int, help="default: --head-dim")
    p.add_argument("--repeat", type=int, help="timed calls per case (default 5); best and "
                   "median are reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (default 1)")
    p.add_argument("--max-time", type=float, help="skip a case predicted to take longer "
                   "than this many seconds per call (default 30)")
    p.add_argument("--budget", type=float, help="stop repeating a case after this many "
                   "seconds (default 60)")
    p.add_argument("--max-memory", type=float, help="skip a case predicted to need more "
                   "GiB at its peak (default: half the available memory)")
    p.add_argument("--out", type=Path, help="folder for the JSON and PNG (default: "
                   "bench/results in a portattn checkout, else ./portattn-bench)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse(argv: list[str]) -> tuple[_cases.SweepConfig, argparse.Namespace]:
    args = _parser().parse_args(argv)
    quick = QUICK if args.quick else {}
    defaults = _cases.SweepConfig()

    def pick(name: str, fallback: Any) -> Any:
        given = getattr(args, name, None)
        return given if given is not None else quick.get(name, fallback)

    heads = pick("heads", defaults.shape.heads)
    for name, value in (("batch", args.batch), ("heads", heads), ("head-dim", args.head_dim),
                        ("value-head-dim", args.value_head_dim), ("repeat", args.repeat),
                        ("warmup", args.warmup)):
        if value is not None and value < (0 if name == "warmup" else 1):
            _parser().error(f"--{name} must be positive; got {value}")
    shape = _cases.Shape(batch=args.batch, heads=heads, head_dim=args.head_dim,
                         value_head_dim=args.value_head_dim or args.head_dim)
    dtypes = args.dtypes or (QUICK_DTYPES if args.quick else DTYPES)[args.device]
    config = _cases.SweepConfig(
        sizes=pick("sizes", defaults.sizes),
        backends=args.backends or _backends.default_backends(args.device),
        kernels=args.kernels, dtypes=dtypes, masks=args.masks or defaults.masks,
        device=args.device, shape=shape, repeat=pick("repeat", defaults.repeat),
        warmup=args.warmup, max_time=pick("max_time", defaults.max_time),
        budget=pick("budget", defaults.budget),
        max_memory=(args.max_memory * 2**30 if args.max_memory is not None
                    else _default_memory_limit(args.device)))
    return config, args


def _default_memory_limit(device: str) -> float | None:
    if device == "cuda":
        try:
            import torch

            free, _ = torch.cuda.mem_get_info()
        except Exception:
            return None
        return 0.8 * free
    from .machine import available_memory

    available = available_memory()
    return None if available is None else 0.5 * available


def default_out() -> Path:
    here = Path.cwd()
    if (here / "bench").is_dir() and (here / "portattn").is_dir():
        return here / "bench" / "results"
    return here / "portattn-bench"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 if nothing could be measured, 2 on bad usage."""
    argv = sys.argv[1:] if argv is None else list(argv)
    config, args = parse(argv)
    if config.device == "cuda":
        # JAX would otherwise take 75% of the GPU up front, starving the other libraries.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from .runners import all_runners
    from .sweep import run

    try:
        plan = _cases.plan(config, all_runners())
    except ValueError as e:
        print(f"portattn-bench: error: {e}", file=sys.stderr)
        return 2
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    if not plan.cases:
        print("portattn-bench: nothing to run with these options", file=sys.stderr)
        for item in plan.unsupported:
            print(f"    {item['runner']} [{item['backend']}] {item['dtype']} mask={item['mask']}: "
                  + "; ".join(item["reasons"]), file=sys.stderr)
        return 1
    started = datetime.now(timezone.utc)
    rows, interrupted = run(config, plan, progress=not args.no_progress)
    return _report(config, args, argv, plan, rows, started, interrupted)


def _report(config: _cases.SweepConfig, args: argparse.Namespace, argv: list[str],
            plan: _cases.Plan, rows: list[dict], started: datetime, interrupted: bool) -> int:
    from .machine import describe_machine, summary
    from .report import add_ratios, table, timing_warnings, write_json
    from .runners import all_runners

    add_ratios(rows)
    versions = {f"kernel:{r.name}": r.provenance for r in all_runners() if r.kind == "kernel"}
    machine = describe_machine(config.device, versions)
    shape = dataclasses.asdict(config.shape)
    stamp = started.strftime("%Y-%m-%d %H:%M UTC")
    print(f"\nportattn bench, {stamp}\n{summary(machine)}\n")
    print(table(rows, shape))
    warnings = timing_warnings(rows)
    for warning in warnings:
        print(warning)
    if interrupted:
        print("interrupted: the results cover the cases finished so far")

    out = args.out or default_out()
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"portattn-bench-{config.device}"
    settings = dataclasses.asdict(config)
    settings["masks"] = ["causal" if m else "none" for m in config.masks]
    write_json(base.with_suffix(".json"), {
        "created": started.isoformat(timespec="seconds"), "argv": argv,
        "interrupted": interrupted, "machine": machine, "config": settings,
        "notes": plan.notes, "results": rows, "unsupported": plan.unsupported})
    print(f"raw results: {base.with_suffix('.json')}")
    if not args.no_plot:
        _plot(rows, base.with_suffix(".png"), f"portattn bench {stamp}, {config.device}, "
              + ", ".join(f"{k}={v}" for k, v in shape.items()), warnings)
    if interrupted:
        return 130
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def _plot(rows: list[dict], path: Path, title: str, warnings: list[str]) -> None:
    from .plot import MissingDependency, plot

    try:
        plot(rows, path, title, warnings)
    except MissingDependency as e:
        print(f"no plot: {e}", file=sys.stderr)
        return
    print(f"plot: {path}")
