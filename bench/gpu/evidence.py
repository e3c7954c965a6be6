"""The evidence a GPU check's figures give dispatch, as ``evidence.json`` entries.

Each timed call of the speed and training sections becomes one entry: the device class
and the call (dtype, shape, mask, forward or training), the seconds of every kernel
dispatch can run that the check timed, and where and when. The check's own names map
to kernels as :data:`KERNELS` says; a timing that failed, and a call with fewer than two
kernels timed, give nothing. ``gpu_check --json`` writes the entries of its run beside
the figures (``evidence-<figures file>``); to ship those of one or more runs with the
Triton plugin::

    python bench/gpu/evidence.py bench/figures/gpu-check-h200-2026-12-04-tables-speed.json \\
        > backends/portattn-triton/portattn_triton/evidence.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

FORMAT = 1
#: The check's names of what it timed -> the kernel dispatch runs for it. ``sdpa_flash``
#: is SDPA's default backend for the calls it fuses (what ``torch_sdpa`` gets);
#: ``flex_attention`` is compiled FlexAttention with its block mask made once.
KERNELS = {"triton_flash": "triton_flash", "sdpa_flash": "torch_sdpa",
           "flex_attention": "torch_flex"}


def entries(report: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """The evidence entries of one GPU check report (its JSON, read)."""
    machine = report.get("machine", {})
    if report.get("device") != "cuda" or "capability" not in machine:
        return []
    measured = {"gpu": machine.get("gpu"), "date": report.get("date") or _date(source),
                "torch": machine.get("torch"), "triton": machine.get("triton"),
                "figures": Path(source).name}
    found = []
    for section, mode in (("speed", "forward"), ("training", "training")):
        for row in report.get("figures", {}).get(section, []):
            seconds = {kernel: row[name]["seconds"] for name, kernel in KERNELS.items()
                       if isinstance(row.get(name), dict) and "seconds" in row[name]}
            if len(seconds) < 2:
                continue
            found.append({"device": f"cuda {machine['capability']}",
                          "dtype": row.get("dtype", "bfloat16"), "shape": _shape(row),
                          "mask": _mask(row, section), "mode": mode, "seconds": seconds,
                          "measured": {**measured, "name": row["name"]}})
    return found


def _shape(row: dict[str, Any]) -> list[int]:
    """``(batch, Hq, Hkv, Lq, Lk, D)``: the speed section's shapes are that already,
    the others ``(batch, H, L, D)``."""
    shape = [int(n) for n in row["shape"]]
    if len(shape) == 6:
        return shape
    b, h, n, d = shape
    return [b, h, h, n, n, d]


def _mask(row: dict[str, Any], section: str) -> str:
    if "documents" in row:  # packed documents, causal within each
        return "causal+documents"
    causal = row.get("causal", row["name"] == "causal" if section == "training" else False)
    return "causal" if causal else "none"


def _date(source: str) -> str | None:
    found = re.search(r"\d{4}-\d{2}-\d{2}", Path(source).name)
    return found.group(0) if found else None


def evidence(paths: list[str]) -> dict[str, Any]:
    """The evidence file of the reports at ``paths``."""
    found = []
    for path in paths:
        found += entries(json.loads(Path(path).read_text()), path)
    return {"format": FORMAT, "entries": found}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    print(json.dumps(evidence(argv), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
