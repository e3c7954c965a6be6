"""The core suite's fixtures (``backend``, ``xp``: the harness in portattn.testing) and
the fuzzer's counts in the terminal summary."""

from __future__ import annotations

from fuzz_oracle import COUNTS

from portattn.testing.plugin import backend, xp

__all__ = ["backend", "xp"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not COUNTS:
        return
    terminalreporter.section("differential fuzzer")
    backends = sorted({b for b, _, _ in COUNTS})
    for name in backends:
        # forward calls, gradient calls, calls with non-finite inputs
        for prefix in ("", "grad ", "nonfinite "):
            calls = COUNTS[name, "*", f"{prefix}calls"]
            if not calls:
                continue
            terminalreporter.write_line(f"{name}: {calls} {prefix}calls")
            kernels = sorted({k for b, k, v in COUNTS if b == name and k != "*"
                              and v in (f"{prefix}agreed", f"{prefix}refused")})
            for kernel in kernels:
                agreed = COUNTS[name, kernel, f"{prefix}agreed"]
                refused = COUNTS[name, kernel, f"{prefix}refused"]
                line = f"    {kernel:<20} agreed {agreed:>6}  refused {refused:>6}"
                if COUNTS[name, kernel, f"{prefix}known"]:
                    line += f"  known defect {COUNTS[name, kernel, f'{prefix}known']:>6}"
                terminalreporter.write_line(line)
