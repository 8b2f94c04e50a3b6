#!/usr/bin/env bash
# The integration guide's validation on a CPU machine: verl's own trainer
# (`python -m verl.trainer.main_ppo`, rollout `dynamod`) against a dynamod stack.
# Writes one report file with a PASS/FAIL line per check; exits non-zero if any failed.
#
#   scripts/validate-cpu.sh [--quick] [REPORT]       # default: ./validate-cpu-report.txt
#
#   STACK       the stack to validate: a name under units/stacks/ or a file
#               (default verl-cpu: our CPU worker; verl-vllm-cpu: real dynamo.vllm shards)
#   SHARDS      rollout shards (--var workers=N; default 2, --quick 1)
#   RANKS       FSDP2 trainer ranks over gloo (default 2, --quick 1)
#   STEPS       GRPO steps per training run (default 2)
#   STATE_DIR   the stack's state dir (default /tmp/dynamod-validate-cpu)
#   OVERRIDES   extra main_ppo Hydra overrides, for every trainer run
#
# Checks, in order:
#   stack        dynamod up STACK
#   smoke        verl's validation-only run (trainer.val_only=True) through the stack
#   iteration    main_ppo, GRPO, STEPS steps, RANKS ranks, SHARDS shards: rollout, reward/
#                advantage, actor update, policy sync (a new digest per update)
#   boundary-1   completion token ids and logprobs verl consumed line up with the engine's
#                (verl's actor recomputes every token's logprob at the same weights);
#                terminal and cancelled responses counted apart; plus N requests through
#                the frontend: every completed one as many logprobs as token ids
#   boundary-2   every shard admitted at each update acknowledged the trainer's step with one
#                digest (none held stale); every shard at the last step; post-update
#                generation served at it
#   boundary-3   round-robin and kv, each on a fresh stack (cold cache), the same trainer run
#                (prompts, seed, steps: the same update cadence), then the same fixed prompt
#                set at the same concurrency: reward, generation tokens/s, KV hit rate.
#                --quick: the prompt set only, no trainer run.
#   teardown     dynamod down leaves no process of the stack's, Ray's included
set -uo pipefail
cd "$(dirname "$0")/.."
QUICK=0
if [ "${1:-}" = "--quick" ]; then QUICK=1; shift; fi
REPORT=${1:-validate-cpu-report.txt}
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=${PYTHONPATH:-$PWD}
STACK=${STACK:-verl-cpu}
case "$STACK" in */*|*.toml) STACK_FILE=$STACK ;; *) STACK_FILE=units/stacks/$STACK.toml ;; esac
[ -f "$STACK_FILE" ] || { echo "validate-cpu.sh: refused, nothing run: no stack file $STACK_FILE (STACK=$STACK)" >&2; exit 2; }
if [ $QUICK = 1 ]; then SHARDS=${SHARDS:-1}; RANKS=${RANKS:-1}; else SHARDS=${SHARDS:-2}; RANKS=${RANKS:-2}; fi
STEPS=${STEPS:-2}
STATE=${STATE_DIR:-/tmp/dynamod-validate-cpu}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/validate-cpu-logs.XXXXXX")
read -r -a EXTRA <<<"${OVERRIDES:-}"
DM=("$PY" -m dynamod --state-dir "$STATE")
: > "$REPORT"
failed=0
report() { echo "$1" | tee -a "$REPORT"; case "$1" in FAIL*) failed=1;; esac; }
check() {  # check NAME COMMAND...: PASS/FAIL by exit status, last output line as detail
    local name=$1; shift
    local out; out=$("$@" 2>&1); local rc=$?
    if [ $rc -eq 0 ]; then report "PASS $name: $(tail -n1 <<<"$out" | sed 's/^PASS [a-z0-9-]*: //')"
    else report "FAIL $name (exit $rc): $(tail -n3 <<<"$out" | sed 's/^FAIL [a-z0-9-]*: //' | tr '\n' ' ')"; fi
    return $rc
}
up() { "${DM[@]}" up "$STACK_FILE" --detach --var "workers=$SHARDS" "$@"; }
trainer() {  # trainer LOG ARGS...: main_ppo through the stack, its output kept in LOG
    local log=$1; shift
    "$PY" -m dynamod.integrations.verl.run "$STATE" --data "$LOGS/data" "$@" -- "${EXTRA[@]}" \
        > "$log" 2>&1 || { echo "main_ppo exited $? (log $log):"; tail -n5 "$log"; return 1; }
}
judge() { "$PY" -m dynamod.integrations.verl.trainer_checks "$@" --state-dir "$STATE"; }
validate() { "$PY" -m dynamod.integrations.verl.validate "$@" --state-dir "$STATE"; }
run_id() { "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["run_id"])' "$STATE/run.json" 2>/dev/null; }
down() { "${DM[@]}" down >/dev/null 2>&1; }

# Nothing of an earlier run's may be judged: a stack already up there is taken down.
[ -S "$STATE/dynamod.sock" ] && down
rm -rf "$STATE"

# 1. The stack, the smoke and the training iteration.
check stack up || { report "FAIL smoke: no stack"; echo "report: $REPORT"; rm -rf "$LOGS"; exit 1; }
smoke() { trainer "$LOGS/smoke.log" --val-only --ranks "$RANKS" && judge smoke --log "$LOGS/smoke.log"; }
iteration() {
    trainer "$LOGS/iteration.log" --steps "$STEPS" --ranks "$RANKS" &&
        judge iteration --log "$LOGS/iteration.log" --steps "$STEPS"
}
check smoke smoke
check iteration iteration

# 2. The boundaries, on what the iteration left.
b1=$(judge alignment --log "$LOGS/iteration.log" 2>&1); b1_rc=$?
tokens=$(validate tokens --requests 16 2>&1); tokens_rc=$?
if [ $b1_rc -eq 0 ] && [ $tokens_rc -eq 0 ]; then
    report "PASS boundary-1: ${b1#PASS alignment: }; frontend: ${tokens#PASS tokens: }"
else report "FAIL boundary-1: $(tail -n1 <<<"$b1") | $(tail -n1 <<<"$tokens")"; fi
S=$("$PY" -c 'import sys; from pathlib import Path; from dynamod.client import Client; print(Client(Path(sys.argv[1])).policy_status()["current"])' "$STATE" 2>/dev/null)
b2=$(validate updates 2>&1); b2_rc=$?
steps=$(validate steps --step "${S:--1}" --requests 8 2>&1); steps_rc=$?
if [ $b2_rc -eq 0 ] && [ $steps_rc -eq 0 ]; then
    report "PASS boundary-2: ${b2#PASS updates: }; ${steps#PASS steps: }"
else report "FAIL boundary-2: $(tail -n1 <<<"$b2") | $(tail -n1 <<<"$steps")"; fi

# 3. Routing: the same work on round-robin and on kv, each from a fresh stack (cold cache).
rows=()
for mode in round-robin kv; do
    down; rm -rf "$STATE"
    if ! up --var "router_mode=$mode" >"$LOGS/up-$mode.log" 2>&1; then
        rows+=("FAIL $mode: dynamod up: $(tail -n2 "$LOGS/up-$mode.log" | tr '\n' ' ')"); continue
    fi
    row="$mode:"
    if [ $QUICK = 0 ]; then
        if trainer "$LOGS/routing-$mode.log" --steps "$STEPS" --ranks "$RANKS" >/dev/null; then
            row+=" trainer $(judge summary --log "$LOGS/routing-$mode.log" --label "$mode" | sed 's/^PASS summary [a-z-]*: //')"
        else rows+=("FAIL $mode: the trainer run failed (log $LOGS/routing-$mode.log)"); continue; fi
    fi
    out=$(validate routing --label "$mode" --requests 32 --concurrency 8 2>&1) \
        || { rows+=("FAIL $mode: $(tail -n1 <<<"$out")"); continue; }
    rows+=("$row prompts ${out#PASS routing $mode: }")
done
if printf '%s\n' "${rows[@]}" | grep -q '^FAIL'; then
    report "FAIL boundary-3: $(printf '%s; ' "${rows[@]}")"
else report "PASS boundary-3: $(printf '%s; ' "${rows[@]}")"; fi

# 4. Teardown: nothing of the stack's left, Ray's processes (under $STATE/ray) included.
RUN_ID=$(run_id)
down
left=$("$PY" - "$STATE" "${RUN_ID:-}" <<'EOF'
import os, sys
from dynamod.core.proctable import marked_pids
state, run_id = sys.argv[1], sys.argv[2]
left = set(marked_pids(run_id)) if run_id else set()
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) == os.getpid():
        continue  # this check names the state dir in its own arguments
    try:
        if state.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
            left.add(int(pid))
    except OSError:
        pass
def what(pid: int) -> str:  # a leftover named: its command and state, as /proc says
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        state = [l for l in open(f"/proc/{pid}/status") if l.startswith("State:")][0].split()[1]
    except (OSError, IndexError):
        return f"{pid} (gone)"
    return f"{pid} ({state}: {cmd.strip()[:120] or '?'})"
print(", ".join(map(what, sorted(left))))
EOF
)
if [ -z "$RUN_ID" ]; then report "FAIL teardown: no run id in $STATE/run.json"
elif [ -n "$left" ]; then report "FAIL teardown: processes left: $left"
else report "PASS teardown: dynamod down left no process of run $RUN_ID (Ray included)"; fi
rm -rf "$LOGS"
echo "report: $REPORT"; exit $failed
