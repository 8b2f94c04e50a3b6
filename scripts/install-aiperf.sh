#!/usr/bin/env bash
# Install the load generator's venv, ./.venv-aiperf: PyPI aiperf 0.13.0 (NVIDIA's AIPerf,
# the tool Dynamo's docs benchmark with), for bench/goodput.py. A venv of its own: aiperf
# pins psutil, prometheus_client, rich and pandas at versions other than ./.venv's.
# About 840 MB on disk; seconds from uv's cache, longer the first time (a stamp file
# records what the venv was made from). Needs ./.venv (scripts/install.sh) for uv.
# Nothing is downloaded when the benchmark runs: aiperf reads the served model's own
# tokenizer from disk with HF_HUB_OFFLINE=1 (bench/aiperf.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-aiperf
STAMP="$VENV/.dynamod-install"
# What the venv is made from: a change to either reinstalls.
want="aiperf==0.13.0 $(sha256sum scripts/install-aiperf.sh | cut -c1-16)"
if [ -x "$VENV/bin/aiperf" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    echo "aiperf venv ready in $VENV"
    exit 0
fi
UV=.venv/bin/uv
[ -x "$UV" ] || UV=$(command -v uv || true)
[ -n "$UV" ] || { echo "install-aiperf: no uv (run scripts/install.sh first)" >&2; exit 2; }
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x "$VENV/bin/python" ] || "$UV" venv -q --python "$PY" "$VENV"
# uv, as install-vllm.sh: PyPI only (no local find-links). Without --compile-bytecode
# (compiling the whole venv took 2m13s here, against 7 s for the install from uv's cache, 31 s
# cold): bench/aiperf_run.py runs aiperf with bytecode writing on, so its first run compiles
# what it imports, once.
# a temporary directory of uv's own, as install.sh: its build locks go with it
uv_tmp=$(mktemp -d)
trap 'rm -rf "$uv_tmp"' EXIT
TMPDIR="$uv_tmp" "$UV" pip install --python "$VENV/bin/python" -q "aiperf==0.13.0"
"$VENV/bin/aiperf" --version >/dev/null 2>&1 \
    || { echo "install-aiperf: $VENV/bin/aiperf --version failed" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "aiperf venv ready in $VENV (aiperf $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("aiperf"))'))"
