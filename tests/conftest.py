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
        calls = COUNTS[name, "*", "calls"]
        terminalreporter.write_line(f"{name}: {calls} calls")
        kernels = sorted({k for b, k, _ in COUNTS if b == name and k != "*"})
        for kernel in kernels:
            agreed, refused = COUNTS[name, kernel, "agreed"], COUNTS[name, kernel, "refused"]
            line = f"    {kernel:<20} agreed {agreed:>6}  refused {refused:>6}"
            if COUNTS[name, kernel, "known"]:
                line += f"  known defect {COUNTS[name, kernel, 'known']:>6}"
            terminalreporter.write_line(line)
