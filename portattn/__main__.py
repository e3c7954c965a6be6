"""Command line: ``python -m portattn {info,demo,bench}``."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def info() -> int:
    """Print every installed kernel: provenance, priority, availability, capabilities."""
    from ._registry import kernels

    entries = kernels()
    print(f"portattn {__version__}: {len(entries)} kernels, in dispatch order")
    for entry in entries:
        kernel = entry.kernel
        if kernel is None:
            state = entry.status
        else:
            why = kernel.available()
            state = "available" if why is None else f"unavailable: {why}"
        priority = "-" if kernel is None else kernel.priority
        print(f"\n{entry.name}  ({entry.provenance}, priority {priority}): {state}")
        if kernel is None:
            continue
        for cap, value in kernel.capabilities().items():
            if cap == "priority":
                continue
            if isinstance(value, (frozenset, set)):
                value = ", ".join(sorted(value)) or "-"
            elif isinstance(value, tuple):
                value = f"{value[0]}..{'' if value[1] is None else value[1]}"
            elif isinstance(value, bool):
                value = "yes" if value else "no"
            print(f"    {cap:<16}{value}")
    return 0


def demo() -> int:
    """Run attention on every installed array library; report kernel and agreement."""
    from .demo import run_demo

    return run_demo()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="portattn", description=__doc__)
    parser.add_argument("--version", action="version", version=f"portattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="list installed kernels and what they support")
    sub.add_parser("demo", help="run attention on every installed array library")
    sub.add_parser("bench", help="benchmark the installed kernels", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from ._bench import main as bench_main

        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return info() if args.command == "info" else demo()


if __name__ == "__main__":
    sys.exit(main())
