#!/usr/bin/env bash
# Install everything dynamod and its default stack need into ./.venv.
# PyPI packages only; nothing is downloaded at run time. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# torch first and pinned: 2.13.0 resolves to a CPU build here, anything else pulls CUDA.
"${pip[@]}" "torch==2.13.0"
# ai-dynamo's `aisimulate` requirement is an install-time downloader; the two real
# wheels go in without deps, their actual requirements come from the `stack` extra.
"${pip[@]}" --no-deps "ai-dynamo==1.6.1" "ai-dynamo-runtime==1.6.1"
# The stack extra includes matplotlib (the trainer's reward curve, the chaos timelines).
"${pip[@]}" -e ".[stack,dev,verl]"
# The tiny CPU model the default stack serves: built locally (no download), idempotent.
.venv/bin/python -m dynamod.workers.model "${XDG_CACHE_HOME:-$HOME/.cache}/dynamod/models/tiny-cpu"
echo "dynamod installed in .venv ($(.venv/bin/dynamod --version 2>/dev/null || echo 'cli not ready'))"
