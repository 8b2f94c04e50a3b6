"""verl 0.9.1's own rollout machinery against a running dynamod CPU stack (verl-cpu.toml):
etcd, NATS, two CPU workers, the Dynamo frontend and a Ray head started as a dynamod unit.
verl's LLMServerManager creates the `dynamod` replicas (init_standalone -> launch_servers)
and its global load balancer; requests go through verl's LLMServerClient as the agent
loop sends them; weights go through the server adapter's update_weights, as verl's naive
checkpoint backend calls it. One stack for the whole module (Ray starts slowly)."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Loopback Ray: read by ray at import time, and `import verl` imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray

from dynamod.chaos.stack import engine_call
from dynamod.client import Client
from dynamod.core.proctable import marked_pids
from dynamod.integrations.verl.attach import ray_init_kwargs
from dynamod.integrations.verl.errors import StackNotReadyError
from tests.conftest import Dynamod, pid_alive, unit_by_name, wait_dead
from tests.integration.verl_rig import verl_config

pytestmark = pytest.mark.slow

SHARDS = 2
ISSUE_12 = ("the CPU worker returns no logprobs until issue 12 (real tokens with logprobs "
            "from the tiny Llama) is merged")


@pytest.fixture(scope="module")
def stack() -> Iterator[Dynamod]:
    state = Path(tempfile.mkdtemp(prefix="dmv-", dir="/tmp"))
    dm = Dynamod(state)
    try:
        dm.run("up", "units/stacks/verl-cpu.toml", "--detach", "--var", f"workers={SHARDS}",
               timeout=400, check=True)
        ray.init(**ray_init_kwargs(state), log_to_driver=False)
        yield dm
    finally:
        if ray.is_initialized():
            ray.shutdown()
        dm.teardown()


@pytest.fixture(scope="module")
def before_attach(stack: Dynamod) -> dict[str, tuple[int, int | None]]:
    """Each unit's (restarts, pid) right before verl's manager attaches."""
    return {u["name"]: (u["restarts"], u["pid"]) for u in stack.status()["units"]}


@pytest.fixture(scope="module")
def manager(stack: Dynamod, before_attach: dict[str, tuple[int, int | None]]) -> Any:
    from verl.workers.rollout.llm_server import LLMServerManager

    async def create() -> Any:
        return await LLMServerManager.create(verl_config(stack.state_dir), worker_group=None)

    return asyncio.run(create())


def generate(manager: Any, prompts: list[list[int]], logprobs: bool = True) -> list[Any]:
    client = manager.get_client()

    async def all_of_them() -> list[Any]:
        return await asyncio.gather(*(
            client.generate(f"req-{i}", prompt_ids=p,
                            sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                             "logprobs": logprobs, "max_tokens": 6})
            for i, p in enumerate(prompts)
        ))

    return asyncio.run(all_of_them())


def tiny_weights(scale: float) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    from dynamod.core.paths import cache_dir

    boot = cache_dir() / "models" / "tiny-cpu" / "model.safetensors"
    return [(k, v * scale) for k, v in load_file(str(boot)).items()]


def push_through_verl(stack: Dynamod, step: int, scale: float, **settings: Any) -> Any:
    """verl's naive sync: the trainer rank's rollout object gets update_weights(...)."""
    from verl.workers.rollout.base import get_rollout_class

    config = verl_config(stack.state_dir)
    config.actor_rollout_ref.rollout.engine_kwargs = {
        "dynamod": {"state_dir": str(stack.state_dir), **settings}}
    adapter_cls = get_rollout_class("dynamod", "async")
    adapter = adapter_cls(config=config.actor_rollout_ref.rollout,
                          model_config=config.actor_rollout_ref.model, device_mesh=None)
    try:
        return asyncio.run(adapter.update_weights(iter(tiny_weights(scale)), global_steps=step))
    finally:
        if adapter.colocated is not None:
            adapter.colocated.close()  # its background checkpoint write ends first


# ------------------------------------------------------------------------------------ tests


def test_replicas_attach_without_spawning(
    stack: Dynamod, before_attach: dict[str, tuple[int, int | None]], manager: Any
) -> None:
    status = stack.status()
    frontend = unit_by_name(status, "frontend")
    replicas = manager.get_replicas()
    assert len(replicas) == SHARDS
    assert {r.server_address for r in replicas} == {f"127.0.0.1:{frontend['ports']['http']}"}
    # Nothing new under dynamod: the attach started and restarted nothing (the same units,
    # the same processes). A unit restarted before it (one CI run, cause unseen: its logs
    # were gone) is named with its state changes, so that a next time says why.
    after = {u["name"]: (u["restarts"], u["pid"]) for u in status["units"]}
    changed = {n for n in after.keys() | before_attach.keys()
               if after.get(n) != before_attach.get(n)}  # fmt: skip
    restarted = {u["name"] for u in status["units"] if u["restarts"]}
    moves = [line for line in stack.daemon_log().splitlines()
             if '"unit.state"' in line and any(f'"{n}"' in line for n in restarted)]  # fmt: skip
    assert not changed, (before_attach, after, moves[-20:])
    if restarted:
        print("restarted before the attach:", restarted, *moves[-20:], sep="\n")


def test_generation_returns_engine_tokens_in_order(stack: Dynamod, manager: Any) -> None:
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400]]
    outputs = generate(manager, prompts)
    current = Client(stack.state_dir).policy_status()["current"]
    instances = {i for u in stack.status()["units"] for i in (u.get("dynamo") or {})
                 .get("instance_ids", [])}
    for out in outputs:
        assert 1 <= len(out.token_ids) <= 6
        assert all(isinstance(t, int) for t in out.token_ids)
        assert out.stop_reason == "completed"
        assert out.extra_fields["global_steps"] == current
        assert out.extra_fields["instance_id"] in instances  # a real shard served it
    if all(out.log_probs is None for out in outputs):
        pytest.skip(ISSUE_12)
    for out in outputs:  # boundary 1: one logprob per token, same order
        assert out.log_probs is not None and len(out.log_probs) == len(out.token_ids)
        assert all(lp <= 0.0 for lp in out.log_probs)


def test_sleep_and_wake_up_round_trip(stack: Dynamod, manager: Any) -> None:
    replicas = manager.get_replicas()

    async def both(call: str) -> None:
        await asyncio.gather(*(getattr(r, call)() for r in replicas))

    asyncio.run(both("sleep"))
    answers = ray.get([r.servers[0].sleep.remote() for r in replicas])
    assert all(a["message"] == "Engine already sleeping" for per in answers for a in per)
    assert sorted(a["shard"] for per in answers for a in per) == ["worker@0", "worker@1"]
    asyncio.run(both("wake_up"))
    answers = ray.get([r.servers[0].wake_up.remote() for r in replicas])
    assert all(a["message"] == "Engine already awake" for per in answers for a in per)
    assert len(generate(manager, [[5, 6, 7]])[0].token_ids) >= 1  # serving again


def test_update_weights_reaches_every_shard_and_the_ledger(stack: Dynamod, manager: Any) -> None:
    before = Client(stack.state_dir).policy_status()["current"]
    step = before + 1
    answer = push_through_verl(stack, step, scale=1.01)
    assert set(answer["acks"]) == {"worker@0", "worker@1"} and answer["stale"] == []
    policy = Client(stack.state_dir).policy_status()
    assert policy["current"] == step
    assert policy["current_path"].endswith(f"verl/checkpoints/step-{step}")
    assert {s["name"]: s["policy_version"] for s in policy["shards"]} == {
        "worker@0": step, "worker@1": step}
    outputs = generate(manager, [[1, 2, 3]] * 4)
    assert {o.extra_fields["weight_version"] for o in outputs} == {step}


def test_colocated_update_over_ipc_is_published_with_every_shards_ack(
    stack: Dynamod, manager: Any
) -> None:
    from dynamod.workers.weights import state_dict_digest

    step = Client(stack.state_dir).policy_status()["current"] + 1
    answer = push_through_verl(stack, step, scale=1.03, weight_sync="ipc")
    expected = state_dict_digest(dict(tiny_weights(1.03)))
    assert answer["acks"] == {"worker@0": expected, "worker@1": expected}
    assert answer["stale"] == []
    policy = Client(stack.state_dir).policy_status()
    assert policy["current"] == step and policy["current_digest"] == expected
    assert policy["history"][-1]["how"] == "publish"
    assert policy["current_path"].endswith(f"verl/checkpoints/step-{step}")
    outputs = generate(manager, [[1, 2, 3]] * 4)
    assert {o.extra_fields["weight_version"] for o in outputs} == {step}


def test_a_shard_killed_between_updates_is_replayed_before_verl_reaches_it(
    stack: Dynamod, manager: Any
) -> None:
    old = unit_by_name(stack.status(), "worker@1")
    os.kill(old["pid"], signal.SIGKILL)
    step = Client(stack.state_dir).policy_status()["current"] + 1
    # The next update lands while worker@1 is dead or held: only worker@0 takes it.
    answer = push_through_verl(stack, step, scale=1.02)
    assert "worker@0" in answer["acks"]
    # verl keeps generating meanwhile; every answer is served at the new version.
    outputs = generate(manager, [[4, 3, 2, 1]] * 6)
    assert {o.extra_fields["weight_version"] for o in outputs} == {step}
    stack.wait_ready_again("worker@1", old["pid"], timeout=90)
    replayed = stack.wait_for(
        lambda s: unit_by_name(s, "worker@1").get("policy_version") == step
        and "worker@1" not in s["policy"]["held"],
        timeout=60, what="worker@1 replayed to the current step and admitted")
    assert replayed
    new_instance = set(unit_by_name(stack.status(), "worker@1")["dynamo"]["instance_ids"])
    deadline = time.monotonic() + 30
    served: set[Any] = set()
    while time.monotonic() < deadline and not served & new_instance:
        outs = generate(manager, [[7, 7, 7]] * 6)
        assert {o.extra_fields["weight_version"] for o in outs} == {step}
        served |= {o.extra_fields["instance_id"] for o in outs}
    assert served & new_instance, "the replayed shard never served verl's traffic"


def _paused_by(stack: Dynamod) -> dict[str, list[tuple[int, str]]]:
    return {u["name"]: [(c["pid"], c["why"]) for c in u["policy"]["paused_by"]]
            for u in stack.status()["units"] if (u.get("policy") or {}).get("paused_by")}


def _engine_paused(unit: dict[str, Any]) -> bool:
    return bool(engine_call(unit["dynamo"]["system_url"], "liveness_probe")["paused"])


def test_verl_s_abort_is_claimed_by_its_server_whose_death_rejoins_the_shard(
    stack: Dynamod, manager: Any
) -> None:
    """verl's abort_all_requests pauses a replica's shards from its server actor: dynamod
    names that actor as their pauser until verl's resume_generation releases them. The
    actor killed -9 between the two leaves nobody to resume them: dynamod rejoins them.
    (Replica 0 is gone after; the tests after this one do not use the manager.)"""
    replica = manager.get_replicas()[0]
    pid = ray.get(replica.servers[0].__ray_call__.remote(lambda _: os.getpid()))
    asyncio.run(replica.abort_all_requests())
    assert _paused_by(stack) == {"worker@0": [(pid, "verl replica 0: abort_all_requests")]}
    assert _engine_paused(unit_by_name(stack.status(), "worker@0"))
    asyncio.run(replica.resume_generation())
    assert _paused_by(stack) == {} and stack.status()["policy"]["paused_outside"] == []
    assert not _engine_paused(unit_by_name(stack.status(), "worker@0"))
    asyncio.run(replica.abort_all_requests())
    before = unit_by_name(stack.status(), "worker@0")
    os.kill(pid, signal.SIGKILL)  # a Ray worker of the stack's ray-head unit
    back = stack.wait_for(
        lambda s: s["policy"]["paused_outside"] == []
        and (u := unit_by_name(s, "worker@0"))["state"] == "ready" and u["policy"]["admitted"]
        and not _engine_paused(u) and u,
        timeout=60, what="worker@0 rejoined after verl's server actor died")  # fmt: skip
    assert back["pid"] == before["pid"] and back["restarts"] == before["restarts"]
    assert f'"pid": {pid}' in next(line for line in stack.daemon_log().splitlines()
                                   if '"policy.pause_orphaned"' in line)  # fmt: skip


def test_too_few_shards_is_refused_with_its_diagnosis(stack: Dynamod) -> None:
    from verl.workers.rollout.llm_server import LLMServerManager

    async def create() -> Any:
        return await LLMServerManager.create(verl_config(stack.state_dir, n_gpus=SHARDS + 1),
                                             worker_group=None)

    with pytest.raises(StackNotReadyError) as err:
        asyncio.run(create())
    message = str(err.value)
    assert f"has {SHARDS} admitted rollout shard(s)" in message
    assert f"needs {SHARDS + 1}" in message and "--var workers=N" in message


def test_teardown_leaves_nothing_ray_included(stack: Dynamod) -> None:
    ray_head = unit_by_name(stack.status(), "ray-head")
    run_id = stack.run_id()
    assert run_id and marked_pids(run_id)
    ray.shutdown()
    result = stack.run("down", timeout=120)
    assert result.returncode == 0, result.stderr
    assert not pid_alive(ray_head["pid"])
    assert wait_dead(list(marked_pids(run_id)), timeout=10) == []
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit()
                 and str(stack.state_dir) in _cmdline(p)]
    assert leftovers == [], [_cmdline(p) for p in leftovers]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
