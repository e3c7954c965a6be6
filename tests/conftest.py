"""Test-suite hooks: the fuzzer's counts in the terminal summary."""

from __future__ import annotations

from fuzz_oracle import COUNTS


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not COUNTS:
        return
    terminalreporter.section("differential fuzzer")
    backends = sorted({b for b, _, _ in COUNTS})
    for backend in backends:
        calls = COUNTS[backend, "*", "calls"]
        terminalreporter.write_line(f"{backend}: {calls} calls")
        kernels = sorted({k for b, k, _ in COUNTS if b == backend and k != "*"})
        for kernel in kernels:
            agreed, refused = COUNTS[backend, kernel, "agreed"], COUNTS[backend, kernel, "refused"]
            line = f"    {kernel:<20} agreed {agreed:>6}  refused {refused:>6}"
            if COUNTS[backend, kernel, "known"]:
                line += f"  known defect {COUNTS[backend, kernel, 'known']:>6}"
            terminalreporter.write_line(line)
