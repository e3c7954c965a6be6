"""``python -m portattn tune``: time the kernels on representative calls, write the file.

Each call (library, dtype, head dim, mask kind, size band, forward or training: see
``_tune``) is made with random inputs in its library and timed on every kernel that can
run it, in turns; a training call is the forward and the gradients of q, k and v.
Then each kernel's ``tunables`` are timed, value against value, on the calls that
kernel ran. The library is imported only here, when it is measured.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import itertools
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._dispatch import (
    BAND_SIZES,
    FORMAT,
    TUNE_ENV,
    TuneWarning,
    default_path,
    installed_version,
    machine,
    refresh,
)
from .._lib import trying_tuned

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["LIBRARIES", "MASKS", "main", "measure", "measure_settings", "tune", "write"]


@dataclass(frozen=True)
class _Library:
    """How to make random inputs in one library and wait for a result."""

    name: str
    module: str
    make: Callable[[Any, tuple[int, ...], str, int], Any]
    wait: Callable[[Any, Any], Any]
    train: Callable[[Any, Callable[..., Any], Any, Any, Any], Any] | None = None
    """``train(module, attend, q, k, v)``: the gradients of ``attend(q, k, v).sum()``
    with respect to q, k and v, waited for (None: the library has no autograd)."""
    device: str = "cpu"


def _numpy_make(np: Any, shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _torch_make(torch: Any, shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(getattr(torch, dtype))


def _jax_make(jnp: Any, shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    import numpy as np

    return jnp.asarray(_numpy_make(np, shape, dtype, seed))


def _torch_train(torch: Any, attend: Callable[..., Any], q: Any, k: Any, v: Any) -> Any:
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(attend(*leaves).sum(), leaves)


def _jax_train(jnp: Any, attend: Callable[..., Any], q: Any, k: Any, v: Any) -> Any:
    jax = sys.modules["jax"]  # imported with jax.numpy
    grads = jax.grad(lambda *x: attend(*x).sum(), argnums=(0, 1, 2))(q, k, v)
    return jax.block_until_ready(grads)


def _dask_make(da: Any, shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    import numpy as np

    return da.from_array(_numpy_make(np, shape, dtype, seed), chunks=shape)


LIBRARIES = {
    "numpy": _Library("numpy", "numpy", _numpy_make, lambda _m, out: out),
    "torch": _Library("torch", "torch", _torch_make, lambda _m, out: out, _torch_train),
    "jax": _Library("jax", "jax.numpy", _jax_make, lambda _m, out: out.block_until_ready(),
                    _jax_train),
    "dask": _Library("dask", "dask.array", _dask_make, lambda _m, out: out.compute()),
}
MASKS = ("none", "causal")
MODES = ("forward", "training")
#: Rounds are cut so that the fastest kernel runs for about this many seconds.
ROUND_S = 0.5
#: Kernels this many times slower than the fastest in the warm-up are not raced.
HOPELESS = 10


def _mask(kind: str) -> Any:
    from .. import masks

    return {"none": None, "causal": masks.causal()}[kind]


def _time_in_turns(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Best time of each call, timed in turns (round robin: drift on a shared machine
    then hits every kernel alike), after one warm-up call each. A kernel whose warm-up
    took over :data:`HOPELESS` times the fastest's cannot win: its warm-up time stands."""
    warm = {}
    for name, call in calls.items():
        start = time.perf_counter()
        call()
        warm[name] = time.perf_counter() - start
    fastest = min(warm.values(), default=0.0)
    racing = [name for name, t in warm.items() if t <= HOPELESS * fastest]
    rounds = max(2, min(repeats, int(ROUND_S / max(fastest, 1e-6))))
    best = dict(warm)
    for _ in range(rounds):
        for name in racing:
            start = time.perf_counter()
            calls[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _call(library: str, dtype: str, head_dim: int, mask: str, band_name: str,
          heads: int, mode: str = "forward") -> tuple[Any, Callable[..., Any]] | None:
    """``(plan, run)`` for one representative call: ``run(kernel)`` makes it on that
    kernel and waits for the result (a training call: its gradients). None when the
    library is missing, cannot make that dtype or has no autograd to train with."""
    import importlib

    from .. import attention, explain

    lib = LIBRARIES[library]
    if mode == "training" and lib.train is None:
        return None
    try:
        module = importlib.import_module(lib.module)
    except ImportError:
        return None
    shape = (1, heads, BAND_SIZES[band_name], head_dim)
    try:
        q, k, v = (lib.make(module, shape, dtype, seed) for seed in range(3))
    except (AttributeError, TypeError, ValueError):
        return None
    m = _mask(mask)
    if mode == "training":
        def run(kernel: str) -> Any:
            return lib.train(module, functools.partial(attention, mask=m, kernel=kernel),
                             q, k, v)
        # the plan of a call that needs gradients: asked with inputs that say so
        if library == "torch":
            q, k, v = (x.requires_grad_() for x in (q, k, v))
        return _training_plan(explain(q, k, v, mask=m)), run

    def run(kernel: str) -> Any:
        return lib.wait(module, attention(q, k, v, mask=m, kernel=kernel))
    return explain(q, k, v, mask=m), run


def _training_plan(plan: Any) -> Any:
    """``plan`` with the kernels that take no gradients refused (a JAX array says
    nothing of gradients outside ``jax.grad``)."""
    from dataclasses import replace

    candidates = tuple((e, why or (() if e.kernel.grad else ("no gradients",)))
                       for e, why in plan.candidates)
    return replace(plan, candidates=candidates)


def measure(library: str, dtype: str, head_dim: int, mask: str, band_name: str, *,
            heads: int = 8, repeats: int = 5, mode: str = "forward") -> dict[str, Any] | None:
    """One representative call timed on every kernel that can run it (None when the
    library is missing, cannot make that dtype or cannot train)."""
    made = _call(library, dtype, head_dim, mask, band_name, heads, mode)
    if made is None:
        return None
    plan, run = made
    calls = {}
    for entry, why in plan.candidates:
        if why:
            continue
        try:
            run(entry.name)  # a kernel that fails here is simply not measured
        except Exception as e:  # any failure of a plugin
            warnings.warn(f"tune: {entry.name} failed on {library} {dtype} d={head_dim} "
                          f"{mask} {band_name} {mode}: {e}", TuneWarning, stacklevel=2)
            continue
        calls[entry.name] = functools.partial(run, entry.name)
    times = _time_in_turns(calls, repeats)
    return {"library": library, "device": plan.inputs.device, "dtype": dtype,
            "head_dim": head_dim, "mask": mask, "band": band_name, "mode": mode,
            "shape": [1, heads, BAND_SIZES[band_name], head_dim], "times": times}


def measure_settings(rows: Sequence[dict[str, Any]], *, repeats: int = 5,
                     say: Callable[[str], Any] = print) -> dict[str, Any]:
    """Each value of each kernel's ``tunables``, timed in turns against the others on
    every measured call that kernel ran. The value with the smallest geometric mean of
    its time over the call's best time wins: ``{kernel: {setting: {"chosen": value,
    "ratios": {value: mean}}}}``."""
    from .._dispatch import kernels

    found: dict[str, Any] = {}
    for entry in kernels():
        tunables = entry.kernel.tunables if entry.kernel is not None else {}
        ran = [row for row in rows if entry.name in row["times"]]
        for setting, values in tunables.items():
            logs: dict[str, list[float]] = {str(value): [] for value in values}
            for row in ran:
                made = _call(row["library"], row["dtype"], row["head_dim"], row["mask"],
                             row["band"], row["shape"][1], row.get("mode", "forward"))
                if made is None:
                    continue
                calls = {str(value): functools.partial(_run_with, made[1], entry.name,
                                                       setting, value) for value in values}
                times = _time_in_turns(calls, repeats)
                best = min(times.values())
                for value, t in times.items():
                    logs[value].append(math.log(t / best))
            if not all(logs.values()):
                continue
            ratios = {value: round(math.exp(sum(x) / len(x)), 4) for value, x in logs.items()}
            chosen = min(values, key=lambda value: ratios[str(value)])
            found.setdefault(entry.name, {})[setting] = {"chosen": chosen, "ratios": ratios}
            listed = ", ".join(f"{value} {ratio:.3f}" for value, ratio in ratios.items())
            say(f"{entry.name} {setting}: {chosen} (time over the best, per value: {listed})")
    return found


def _run_with(run: Callable[[str], Any], kernel: str, setting: str, value: Any) -> Any:
    with trying_tuned(kernel, setting, value):
        return run(kernel)


def _distribution_versions(libraries: Sequence[str]) -> dict[str, str]:
    """Versions of portattn, every kernel's distribution and the measured libraries."""
    from .. import __version__
    from .._dispatch import kernels

    versions = {"portattn": __version__}
    versions.update({e.distribution: e.version for e in kernels()})
    owners = importlib.metadata.packages_distributions()
    for library in libraries:
        for dist in owners.get(LIBRARIES[library].module.split(".")[0], []):
            found = installed_version(dist)
            if found is not None:
                versions[dist] = found
    return versions


def tune(libraries: Sequence[str], dtypes: Sequence[str], head_dims: Sequence[int],
         mask_kinds: Sequence[str], bands: Sequence[str], *, repeats: int = 5,
         modes: Sequence[str] = MODES, say: Callable[[str], Any] = print) -> dict[str, Any]:
    """Measure every combination; returns the tune file's contents."""
    rows = []
    combinations = itertools.product(libraries, modes, dtypes, head_dims, mask_kinds, bands)
    for library, mode, dtype, head_dim, mask, band_name in combinations:
        row = measure(library, dtype, head_dim, mask, band_name, repeats=repeats, mode=mode)
        if row is None:
            continue
        rows.append(row)
        ranked = sorted(row["times"].items(), key=lambda item: item[1])
        listed = ", ".join(f"{n} {t * 1e3:.3g} ms" for n, t in ranked)
        say(f"{library} {mode} {dtype} d={head_dim} {mask} {band_name} "
            f"(L={BAND_SIZES[band_name]}): {listed}")
    measured = sorted({row["library"] for row in rows})
    settings = measure_settings(rows, repeats=repeats, say=say)
    return {"format": FORMAT,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "versions": _distribution_versions(measured), "entries": rows,
            "settings": settings}


def write(contents: dict[str, Any], path: Path) -> None:
    """Write the file whole or not at all (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(contents, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, path)
    refresh()


def _csv(kind: Callable[[str], Any], allowed: Sequence[Any] | None = None
         ) -> Callable[[str], list[Any]]:
    """An option's parser: comma-separated values of ``kind``, among ``allowed``."""
    import argparse

    def parse(text: str) -> list[Any]:
        try:
            values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            values = []
        if not values or any(allowed is not None and v not in allowed for v in values):
            among = f" of {', '.join(map(str, allowed))}" if allowed else f" of {kind.__name__}"
            msg = f"expected a comma-separated list{among}; got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        return values
    return parse


def main(argv: Sequence[str]) -> int:
    """``python -m portattn tune [options]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="portattn tune",
        description="time the kernels on this machine; dispatch then prefers the measured "
                    "fastest kernel for calls like the ones timed")
    parser.add_argument("--libraries", type=_csv(str, list(LIBRARIES)), default=["numpy", "torch"],
                        help="default: numpy,torch (those installed are measured)")
    parser.add_argument("--dtypes", type=_csv(str), default=None,
                        help="default: float32,float64 (--quick: float32)")
    parser.add_argument("--head-dims", type=_csv(int), default=None,
                        help="default: 64,128 (--quick: 64)")
    parser.add_argument("--masks", type=_csv(str, MASKS), default=list(MASKS),
                        help="default: none,causal")
    parser.add_argument("--bands", type=_csv(str, list(BAND_SIZES)), default=None,
                        help="default: short,medium,long (--quick: short,medium)")
    parser.add_argument("--modes", type=_csv(str, MODES), default=list(MODES),
                        help="default: forward,training (training: forward and gradients, "
                        "on the libraries with autograd)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer calls: the defaults above marked --quick")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds per call at most (default 5)")
    parser.add_argument("--output", type=Path, default=None,
                        help=f"the file to write (default: ${TUNE_ENV}, else the user cache)")
    args = parser.parse_args(list(argv))
    quick = args.quick
    args.dtypes = args.dtypes or (["float32"] if quick else ["float32", "float64"])
    args.head_dims = args.head_dims or ([64] if quick else [64, 128])
    args.bands = args.bands or (["short", "medium"] if quick else list(BAND_SIZES))
    path = args.output or default_path()
    if path is None:
        parser.error(f"{TUNE_ENV} is set empty (measured dispatch off); pass --output")
    contents = tune(args.libraries, args.dtypes, args.head_dims, args.masks, args.bands,
                    repeats=args.repeats, modes=args.modes)
    if not contents["entries"]:
        print("nothing measured: none of the libraries is installed", file=sys.stderr)
        return 1
    write(contents, path)
    print(f"wrote {len(contents['entries'])} measured calls to {path}")
    return 0
