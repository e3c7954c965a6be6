"""What the GPU check found: every check's status and every figure, as JSON.

A check is ``ok``, ``tf32`` (float32 within the TF32 tolerance only, reported, not a
failure), ``skip`` (with the reason) or ``FAIL``; the run fails when any check
failed or when no check ran at all.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from typing import Any

STATUSES = ("ok", "tf32", "skip", "FAIL")


@dataclass
class Report:
    device: str
    started: float = field(default_factory=time.time)
    checks: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)

    def check(self, section: str, name: str, status: str, detail: str = "",
              **values: Any) -> str:
        if status not in STATUSES:
            msg = f"status must be one of {', '.join(STATUSES)}; got status={status!r}"
            raise ValueError(msg)
        self.checks.append({"section": section, "name": name, "status": status,
                            "detail": detail, **values})
        if status not in ("ok", "skip"):
            print(f"    {status:<4} {section}: {name}: {detail}")
        return status

    def figure(self, section: str, **values: Any) -> None:
        self.figures.setdefault(section, []).append(values)

    def count(self, status: str, section: str | None = None) -> int:
        return sum(c["status"] == status for c in self.checks
                   if section is None or c["section"] == section)

    @property
    def failures(self) -> int:
        ran = sum(c["status"] != "skip" for c in self.checks)
        return self.count("FAIL") + (ran == 0)  # nothing ran: that is a failure too

    def summary(self) -> str:
        parts = [f"{self.count(s)} {s}" for s in STATUSES if self.count(s)]
        return ", ".join(parts) or "no checks ran"

    def as_json(self) -> dict[str, Any]:
        return {"device": self.device, "machine": self.machine,
                "date": time.strftime("%Y-%m-%d", time.gmtime(self.started)),
                "python": platform.python_version(),
                "seconds": round(time.time() - self.started, 1),
                "summary": self.summary(), "failures": self.failures,
                "checks": self.checks, "figures": self.figures}

    def write(self, path: Any) -> None:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.as_json(), indent=1, default=str) + "\n")
