"""portattn's command line: the installed kernels (info), which kernel would run a call
and why (explain), a check on every array library (demo), the benchmark report (bench)
and the dispatch measurements (tune)."""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import TYPE_CHECKING

from . import __version__
from ._commands import add_explain_arguments, run_demo, run_explain, tune_main

if TYPE_CHECKING:
    from .kernel import Kernel

_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}
"""Dtypes in short; mask kinds keep the names of ``portattn.masks.KINDS``."""
WIDTH = 100
"""The narrow table fits this many columns; ``info --wide`` puts everything in one."""
_FLAGS = ("bias", "softcap", "alibi", "sinks", "gqa", "value_head_dim", "empty",
          "returns_lse", "returns_weights", "dropout", "dropout_seed", "grad",
          "deterministic", "finite_inputs_only")
_FLAG_TITLES = ("bias", "cap", "alibi", "sinks", "gqa", "dv", "empty", "lse", "wts", "drop",
                "seed", "grad", "det", "fin")


def _listed(values: object, order: tuple[str, ...] = ()) -> str:
    if isinstance(values, str):
        return values
    ranked = sorted(values, key=lambda v: (order.index(v) if v in order else len(order), v))
    return ",".join(_SHORT.get(v, v) for v in ranked) or "-"


def _mask_kinds(declared: frozenset[str]) -> str:
    """``all`` (every kind of ``portattn.masks.KINDS``), ``all but ...``, or a list."""
    from .masks import KINDS

    missing = [k for k in KINDS if k not in declared]
    if not missing:
        return "all"
    if len(missing) < len(KINDS) // 2:
        return "all but " + _listed(missing, KINDS)
    return _listed(declared, KINDS)


def _score_changes(kernel: Kernel) -> tuple[str, str]:
    """The score changes a kernel takes: ``all`` (every kind of
    ``portattn.scores.ADDITIVE_KINDS``), a list or ``-``; and whether it takes
    functions (``scores.function``, ``scores.softcap``)."""
    from .scores import ADDITIVE_KINDS

    tables = kernel.score_mod
    listed = ("all" if tables is True or tables == ADDITIVE_KINDS
              else _listed(tables) if tables else "-")
    return listed, "yes" if kernel.score_functions else "-"


def info(wide: bool = False) -> int:
    """Print every installed kernel: provenance, priority, availability, and tables of
    what each declares it supports (one table with ``wide``, else two of at most
    :data:`WIDTH` columns), then the score changes each takes."""
    from ._dispatch import availability, kernels

    entries = kernels()
    print(f"portattn {__version__}: {len(entries)} kernels, in dispatch order\n")
    rows = [("kernel", "distribution", "priority", "status")]
    for entry in entries:
        kernel = entry.kernel
        if kernel is None:
            rows.append((entry.name, entry.provenance, "-", entry.status or ""))
            continue
        why = availability(entry)
        rows.append((entry.name, entry.provenance, str(kernel.priority),
                     "available" if why is None else f"unavailable: {why}"))
    _table(rows)
    dtypes = ("float16", "bfloat16", "float32", "float64")
    where = [("kernel", "namespaces", "devices", "dtypes", "head_dim", "masks")]
    options = [("kernel", *_FLAG_TITLES)]
    changes = [("kernel", "functions", "score changes from tables")]
    for entry in entries:
        k = entry.kernel
        if k is None:
            continue
        low, high = k.head_dim
        where.append((entry.name, _listed(k.namespaces), _listed(k.devices),
                      _listed(k.dtypes, dtypes), f"{low}-{'' if high is None else high}",
                      _mask_kinds(k.masks)))
        options.append((entry.name, *("yes" if getattr(k, flag) else "-" for flag in _FLAGS)))
        tables, functions = _score_changes(k)
        changes.append((entry.name, functions, tables))
    legend = ("masks: all = every kind of portattn.masks.KINDS; cap = softcap, dv = value "
              "head dim != head dim, wts = weights, drop = dropout, seed = dropout from "
              "dropout_seed (the same pairs in every such kernel), det = deterministic, "
              "fin = finite inputs only")
    if wide:
        print(f"\ndeclared capabilities ({legend}):")
        _table([w + o[1:] for w, o in zip(where, options, strict=True)])
    else:
        print("\nwhere each kernel runs, and the masks it takes (one table: info --wide):")
        _table(where, wrap=WIDTH)
        print("\nwhat else it takes and gives:")
        _table(options)
        print("\n" + textwrap.fill(legend, WIDTH))
    print("\nscore changes each takes (portattn.scores; all = every kind that adds from a "
          "table):")
    _table(changes, wrap=WIDTH)
    tuned = [(entry.name, name, ",".join(map(str, values)), str(entry.kernel.tuned(name)))
             for entry in entries if entry.kernel is not None
             for name, values in entry.kernel.tunables.items()]
    if tuned:
        print("\nsettings `python -m portattn tune` chooses (None: not tuned here):")
        _table([("kernel", "setting", "values timed", "tuned"), *tuned])
    return 0


def _table(rows: list[tuple[str, ...]], wrap: int | None = None) -> None:
    """Print ``rows`` in columns; with ``wrap``, a last cell that would pass that many
    characters continues on the next lines, broken after its commas."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    if wrap is not None:
        widths[-1] = min(widths[-1], max(wrap - indent, 1))
    for row in rows:
        *first, last = row
        lines = [last] if wrap is None else textwrap.wrap(
            last.replace(",", ", "), max(wrap - indent, 1), break_on_hyphens=False) or [""]
        lines = [line.replace(", ", ",") for line in lines]
        cells = [cell.ljust(w) for cell, w in zip(first, widths, strict=False)]
        print("  ".join([*cells, lines[0]]).rstrip())
        for line in lines[1:]:
            print(" " * indent + line)


COMMANDS = "portattn.commands"
"""Entry-point group of subcommands that other distributions add (``bench``)."""
BENCH_INSTALL = "`pip install ./bench/portattn-bench` from a clone of portattn"


def delegated(name: str, argv: list[str]) -> int:
    """Run the subcommand ``name`` that another distribution provides."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=COMMANDS) if ep.name == name]
    if not found:
        print(f"portattn {name}: no installed distribution provides this command; the "
              f"benchmark report comes with {BENCH_INSTALL}", file=sys.stderr)
        return 2
    return found[0].load()(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="portattn", description=__doc__)
    parser.add_argument("--version", action="version", version=f"portattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info_parser = sub.add_parser("info", help="list installed kernels and what they support")
    info_parser.add_argument("--wide", action="store_true",
                             help="one table of every capability (wider than 100 columns)")
    explain_parser = sub.add_parser(
        "explain", help="which kernel would run a call of given shapes, dtype, library and "
        "masks, and why the others would not (computes nothing)",
        description="Print what portattn.explain prints for a call described by its "
        "options, e.g.: python -m portattn explain --shape 2,8,1024,64 --dtype float16 "
        "--library torch --mask causal")
    add_explain_arguments(explain_parser)
    sub.add_parser("demo", help="run attention on every installed array library")
    sub.add_parser("bench", help=f"benchmark the installed kernels (needs {BENCH_INSTALL})",
                   add_help=False)
    sub.add_parser("tune", help="time the kernels here; dispatch then prefers the fastest",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "tune":
        return tune_main(rest)
    if args.command == "bench":
        return delegated("bench", rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "explain":
        return run_explain(args)
    return info(args.wide) if args.command == "info" else run_demo()


if __name__ == "__main__":
    sys.exit(main())
