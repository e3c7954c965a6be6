#!/usr/bin/env bash
# The GPU check on a bare GPU machine with no package index (run from anywhere):
#
#     bash bench/gpu/run.sh [WHEELS] [OUT]
#
# WHEELS (default bench/gpu/wheels, built by bench/gpu/pack.py) is installed with
# pip --no-index into a fresh folder, next to the machine's own torch, triton, cupy
# and numpy; then bench/gpu_check.py runs against those installed packages (not the
# checkout) and writes every figure to OUT/gpu_check.json (default bench/gpu/results).
# Exit status: the check's (0 all passed, 1 a check failed, 2 no GPU), 3 when the
# install failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
wheels="${1:-$here/wheels}"
out="${2:-$here/results}"
site="$(mktemp -d /tmp/portattn-site.XXXXXX)"
python="${PYTHON:-python3}"
mkdir -p "$out"
if ! "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$site" "$wheels"/*.whl; then
    echo "run.sh: installing $wheels failed" >&2
    exit 3
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A checkout's portattn must not shadow the installed one: run from outside the tree.
cd /tmp && "$python" "$here/../gpu_check.py" --json "$out/gpu_check.json" "${@:3}"
