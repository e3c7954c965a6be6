"""Build what the GPU check needs on a machine with no package index.

    python bench/gpu/pack.py [DIR]      # default: bench/gpu/wheels

Wheels of portattn, portattn-torch and portattn-triton (built from this checkout) and
of array-api-compat and array-api-extra (the versions installed here, from the
index): pure Python, a few hundred KB. torch, triton, cupy and numpy are not packed:
the check uses the GPU machine's own. ``bench/gpu/run.sh`` installs the folder there
with ``pip install --no-index``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCAL = (".", "backends/portattn-torch", "backends/portattn-triton")
FROM_INDEX = ("array-api-compat", "array-api-extra")


def pack(out: Path) -> list[Path]:
    """Build every wheel into ``out`` (emptied first); returns the wheel files."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), *(str(ROOT / p) for p in LOCAL)], check=True)
    pinned = [f"{name}=={version(name)}" for name in FROM_INDEX]
    subprocess.run([*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--dest", str(out), *pinned], check=True)
    wheels = sorted(out.glob("*.whl"))
    names = {w.name.split("-")[0].replace("_", "-").lower() for w in wheels}
    missing = {"portattn", "portattn-torch", "portattn-triton", *FROM_INDEX} - names
    if missing:
        msg = f"pack: no wheel for {', '.join(sorted(missing))} in {out}"
        raise RuntimeError(msg)
    return wheels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path(__file__).parent / "wheels")
    args = parser.parse_args(argv)
    wheels = pack(args.out)
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.name} ({w.stat().st_size / 1024:.0f} KB)")
    print(f"pack: {len(wheels)} wheels, {total / 1024:.0f} KB in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
