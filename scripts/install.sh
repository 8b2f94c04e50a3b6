#!/usr/bin/env bash
# Install everything dynamod and its default stack need into ./.venv.
# PyPI packages (and, where missing, three Debian tool packages); nothing is downloaded at
# run time. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# The multi-node tests make network namespaces (ip, nsenter) and look at sockets and
# certificates (ss, openssl): Debian's iproute2, util-linux and openssl; the status page's
# test opens it in a real browser: Debian's chromium-headless-shell (chromium will do).
# Installed here when missing and we may (root with apt-get); without them those tests
# skip, saying why.
apt_install() {  # PACKAGE...: where root with apt-get; a failure is a note, not an error
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 0
    local apt=(apt-get install -y -q --no-install-recommends "$@")
    "${apt[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && "${apt[@]}" >/dev/null; } \
        || echo "note: apt-get could not install $*; the tests that need them will skip" >&2
}
missing=()
for tool in ip:iproute2 ss:iproute2 nsenter:util-linux openssl:openssl; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool##*:}")
done
[ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
# on its own: a distribution without this package still gets the tools above
command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null \
    || apt_install chromium-headless-shell
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# torch first and pinned, with pip: 2.13.0 is a CPU build on this machine's disk, which only
# pip looks at (elsewhere it resolves to a CPU build too); anything else pulls CUDA. uv
# (PyPI) installs the rest: the same versions as pip, in about half the time and 40 % of
# the CPU (fresh caches, 2026-12-01: 4.3 min and 85 CPU-s against 8.5 min and 212 CPU-s).
# --compile-bytecode as pip does: without it every first import in the suite (torch in the
# trainer, Ray's many processes) compiled its modules, and a fresh run took 19 min, not 15.
"${pip[@]}" "torch==2.13.0" "uv==0.13.9"
# uv leaves a lock file in the temporary directory for each setuptools build it runs
# (uv-setuptools-HASH.lock, one per install of this checkout): it gets a directory of its
# own, removed on exit, so an install leaves nothing in /tmp.
uv_tmp=$(mktemp -d)
trap 'rm -rf "$uv_tmp"' EXIT
uv=(env TMPDIR="$uv_tmp" .venv/bin/uv pip install --python .venv/bin/python --compile-bytecode -q)
# ai-dynamo's `aisimulate` requirement is an install-time downloader; the two real
# wheels go in without deps, their actual requirements come from the `stack` extra.
"${uv[@]}" --no-deps "ai-dynamo==1.6.1" "ai-dynamo-runtime==1.6.1"
# The stack extra includes matplotlib (the trainer's reward curve, the chaos timelines).
"${uv[@]}" -e ".[stack,dev,verl]"
# The checkout's own modules, compiled as site-packages are: with PYTHONDONTWRITEBYTECODE=1
# (as on the project's machines) every daemon, CLI, worker and trainer start otherwise
# compiled dynamod from source again (~0.2 s of CPU per daemon start; the suite starts
# hundreds). A source edited later is compiled in memory as before.
.venv/bin/python -m compileall -q -j 0 dynamod bench tests >/dev/null
# The tiny CPU model the default stack serves: built locally (no download), idempotent.
.venv/bin/python -m dynamod.workers.model "${XDG_CACHE_HOME:-$HOME/.cache}/dynamod/models/tiny-cpu"
echo "dynamod installed in .venv ($(.venv/bin/dynamod --version 2>/dev/null || echo 'cli not ready'))"
