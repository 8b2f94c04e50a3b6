#!/usr/bin/env bash
# The integration guide's validation on a GPU machine, against a dynamod-supervised stack.
# Writes one report file with a PASS/FAIL line per check; exits non-zero if any failed.
#
#   MODEL_PATH=/models/Qwen2.5-0.5B-Instruct VERL_DIR=/workspace/verl \
#   TRAIN_FILE=/data/gsm8k/train.parquet VAL_FILE=/data/gsm8k/test.parquet \
#   scripts/validate-gpu.sh [REPORT]          # default: ./validate-gpu-report.txt
#
# Needs: 2 GPUs, ai-dynamo[vllm]==1.6.1 in this venv (or VLLM_PYTHON=...), verl 0.9.1
# (the verl extra), and a verl checkout with verl-recipe at $VERL_DIR/recipe (the guide's
# layout) for the smoke and the KV-metrics sidecar. Checks, in order:
#   smoke       the guide's validation smoke (recipe/dynamo/smoke_dynamo_v1.sh; it starts its
#               own etcd/NATS/worker/frontend, so it runs before dynamod's stack)
#   stack       dynamod up units/stacks/verl-native.toml (kv, ThunderAgent off, 2 GPUs)
#   tokens      boundary 1: token ids and logprobs match in length and order; completed,
#               aborted and failed attempts counted apart
#   train       one training iteration through rollout `dynamod` (2 steps: optimizer step,
#               policy sync, generation after the update). WEIGHT_SYNC=ipc (default): the
#               colocated CUDA IPC path into dynamod's worker extension in each dynamo.vllm
#               shard, then `policy publish` with each shard's acknowledgement and a
#               background replay checkpoint per step; WEIGHT_SYNC=push: a checkpoint per
#               step and `policy push`
#   updates     boundary 2, per update (ipc only): every admitted shard acknowledged the
#               trainer's step, one digest, publish held none (<state>/verl/updates.jsonl)
#   steps       boundary 2: every shard at the trainer's step, post-update generation served
#   routing-*   boundary 3: round-robin and kv, same prompts, concurrency and a cold cache
#               (a fresh stack each), same update cadence (no update during either run);
#               completion tokens/s and KV hit rate. Reward comes from the train check's log.
#   teardown    dynamod down leaves nothing
#
# Without 2 GPUs, or without a vLLM that dynamo.vllm and dynamod's worker extension can
# import, it refuses with one line on stderr and exit status 2, before it runs or writes
# anything (on CPU, run the verl tests instead: README, section verl).
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-validate-gpu-report.txt}
PY=${PYTHON:-.venv/bin/python}
refuse() { echo "validate-gpu.sh: refused, nothing run: $1" >&2; exit 2; }
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[ "${gpus:-0}" -ge 2 ] || refuse "needs 2 NVIDIA GPUs; nvidia-smi lists ${gpus:-0}"
VLLM_PY=${VLLM_PYTHON:-$PY}
"$VLLM_PY" -c 'import vllm, dynamo.vllm' >/dev/null 2>&1 \
    || refuse "$VLLM_PY cannot import vllm and dynamo.vllm (install ai-dynamo[vllm]==1.6.1 there, or set VLLM_PYTHON)"
"$VLLM_PY" -c 'import dynamod.integrations.verl.worker_extension' >/dev/null 2>&1 \
    || refuse "$VLLM_PY cannot import dynamod's worker extension (pip install -e . into it)"
WEIGHT_SYNC=${WEIGHT_SYNC:-ipc}
DM=(.venv/bin/dynamod --state-dir "${STATE_DIR:-/tmp/dynamod-validate}")
STATE=${STATE_DIR:-/tmp/dynamod-validate}
: "${MODEL_PATH:?set MODEL_PATH to a local model directory}"
: "${VERL_DIR:?set VERL_DIR to a verl checkout with verl-recipe at VERL_DIR/recipe}"
VARS=(--var "model_path=$MODEL_PATH" --var "model_name=$(basename "$MODEL_PATH")"
      --var "verl_dir=$VERL_DIR" --var "vllm_python=${VLLM_PYTHON:-$PY}")
: > "$REPORT"
failed=0
report() { echo "$1" | tee -a "$REPORT"; case "$1" in FAIL*) failed=1;; esac; }
check() {  # check NAME COMMAND...: PASS/FAIL by exit status, last output line as detail
    local name=$1; shift
    local out; out=$("$@" 2>&1); local rc=$?
    if [ $rc -eq 0 ]; then report "PASS $name: $(tail -n1 <<<"$out")"
    else report "FAIL $name (exit $rc): $(tail -n3 <<<"$out" | tr '\n' ' ')"; fi
    return $rc
}
validate() { "$PY" -m dynamod.integrations.verl.validate "$@" --state-dir "$STATE"; }

# 1. The guide's smoke, as upstream ships it (recipe-managed processes, not dynamod's).
check smoke bash -c "cd '$VERL_DIR' && MODEL_PATH='$MODEL_PATH' TRAIN_FILE='${TRAIN_FILE:-}' \
    TEST_FILE='${VAL_FILE:-}' bash recipe/dynamo/smoke_dynamo_v1.sh | grep 'PASS: Dynamo validation smoke completed'"

# 2. The stack under dynamod, then the boundaries.
check stack "${DM[@]}" up units/stacks/verl-native.toml --detach "${VARS[@]}" || { cat "$REPORT"; exit 1; }
check tokens validate tokens --requests 64
RAY_ADDRESS=$("$PY" -c "import sys; from pathlib import Path; from dynamod.integrations.verl.attach import ray_init_kwargs; print(ray_init_kwargs(Path(sys.argv[1]))['address'])" "$STATE")
check train env RAY_ADDRESS="$RAY_ADDRESS" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 DYNAMOD_STATE_DIR="$STATE" \
    "$PY" -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="${TRAIN_FILE:?set TRAIN_FILE}" data.val_files="${VAL_FILE:?set VAL_FILE}" \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.rollout.name=dynamod actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.checkpoint_engine.backend=naive \
    ++actor_rollout_ref.rollout.engine_kwargs.dynamod.state_dir="$STATE" \
    ++actor_rollout_ref.rollout.engine_kwargs.dynamod.router_mode=kv \
    ++actor_rollout_ref.rollout.engine_kwargs.dynamod.weight_sync="$WEIGHT_SYNC" \
    trainer.n_gpus_per_node=2 trainer.nnodes=1 trainer.total_training_steps=2 \
    trainer.logger=console trainer.val_before_train=false
[ "$WEIGHT_SYNC" = ipc ] && check updates validate updates
STEP=$("$PY" -c "import sys; from pathlib import Path; from dynamod.client import Client; print(Client(Path(sys.argv[1])).policy_status()['current'])" "$STATE")
if [ "$STEP" -ge 1 ] 2>/dev/null; then check steps validate steps --step "$STEP"
else report "FAIL steps: the ledger is at version ${STEP:-?}: no update went through"; fi

# 3. Routing: the same workload on round-robin and on kv, each from a cold cache.
for mode in round-robin kv; do
    "${DM[@]}" down >/dev/null 2>&1
    check "stack-$mode" "${DM[@]}" up units/stacks/verl-native.toml --detach "${VARS[@]}" \
        --var "router_mode=$mode" || continue
    check "routing-$mode" validate routing --label "$mode" --requests 256 --concurrency 32
done

check teardown "${DM[@]}" down
echo "report: $REPORT"; exit $failed
