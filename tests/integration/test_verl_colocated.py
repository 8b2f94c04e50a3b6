"""The colocated weight path (verl's `weight_sync: ipc`) on CPU, for real: a trainer process
sends the tiny model's tensors as shared-memory handles over ZMQ, in buckets, into the
worker extension hosted by two running CPU workers (the class dynamo.vllm loads with
`--worker-extension-cls`), then publishes the step with each shard's acknowledged digest.
The stack is the default one without its trainer (no Ray: the transport needs none)."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import select
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dynamod.client import Client
from dynamod.core.paths import cache_dir
from dynamod.integrations.verl.colocated import ColocatedSync
from dynamod.integrations.verl.errors import StackNotReadyError
from dynamod.integrations.verl.ipc import WeightSender, socket_address, transfer_digest
from dynamod.workers.weights import load_checkpoint, state_dict_digest
from tests.conftest import Dynamod, unit_by_name
from tests.integration.policystack import ledger_revisions

pytestmark = pytest.mark.slow

EXTENSION = "dynamod.integrations.verl.worker_extension.DynamodWorkerExtension"
BUCKET = 64 << 10  # smaller than the tiny model's largest tensors: several buckets, some alone

TRAINER = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    from safetensors.torch import load_file
    from dynamod.core.paths import cache_dir
    from dynamod.integrations.verl.colocated import ColocatedSync

    state, step, scale, bucket, timeout, rank, world = (
        Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]),
        float(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]))
    boot = load_file(str(cache_dir() / "models" / "tiny-cpu" / "model.safetensors"))
    sync = ColocatedSync(state, state / "verl" / "checkpoints", state / "weight-ipc",
                         bucket_bytes=bucket, timeout_s=timeout, rank=rank, world=world)
    result = asyncio.run(sync.update(((k, v * scale) for k, v in boot.items()), step))
    sync.close()  # the background checkpoint write ends before the process does
    print(json.dumps(result))
""")


def scaled(scale: float) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    boot = load_file(str(cache_dir() / "models" / "tiny-cpu" / "model.safetensors"))
    return {k: v * scale for k, v in boot.items()}


def trainer_command(state: Path, step: int, scale: float, timeout: float = 30.0,
                    rank: int = 0, world: int = 1) -> list[str]:
    return [sys.executable, "-c", TRAINER, str(state), str(step), str(scale), str(BUCKET),
            str(timeout), str(rank), str(world)]


def trainer_update(state: Path, step: int, scale: float, timeout: float = 30.0) -> Any:
    """One update from a trainer process of its own, as verl's trainer rank would send it."""
    result = subprocess.run(trainer_command(state, step, scale, timeout), capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stack() -> Iterator[Dynamod]:
    state = Path(tempfile.mkdtemp(prefix="dmc-", dir="/tmp"))
    dm = Dynamod(state)
    try:
        dm.run("up", "units/stacks/local.toml", "--detach", "--var", "trainer_steps=0",
               "--var", "workers=2", "--var", f"worker_extension_cls={EXTENSION}",
               "--var", f"weight_ipc_dir={state}/weight-ipc", timeout=300, check=True)
        yield dm
    finally:
        dm.teardown()


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def engine(stack: Dynamod, shard: str, route: str) -> dict[str, Any]:
    url = unit_by_name(stack.status(), shard)["dynamo"]["system_url"]
    status, answer = post(f"{url}/engine/{route}", {})
    assert status == 200, answer
    return dict(answer)


def completions(stack: Dynamod, version: int, n: int, instance: int | None = None
                ) -> list[dict[str, Any]]:
    """n completions that require `version`'s taint; `instance`: pinned to that Dynamo
    instance instead (`backend_instance_id`)."""
    port = unit_by_name(stack.status(), "frontend")["ports"]["http"]
    nvext: dict[str, Any] = {"extra_fields": ["engine_data"]}
    if instance is None:
        nvext["routing_constraints"] = {"required_taints": [f"dynamod.policy/{version}"]}
    else:
        nvext["backend_instance_id"] = instance
    body = {"model": "tiny-cpu", "prompt": [1, 2, 3, 4], "max_tokens": 2, "nvext": nvext}
    out = []
    for _ in range(n):
        status, answer = post(f"http://127.0.0.1:{port}/v1/completions", body)
        assert status == 200, answer
        out.append(answer["nvext"]["engine_data"])
    return out


# ------------------------------------------------------------------------------ transport


RECEIVER = textwrap.dedent("""
    import os, pickle, sys, time
    from dynamod.integrations.verl.ipc import WeightReceiver

    class Keep:
        def __init__(self): self.kept, self.aborted = {}, []
        def begin(self, step): self.kept = {}
        def load(self, weights): self.kept.update((n, t.clone()) for n, t in weights)
        def finish(self, step, digest):
            with open(sys.argv[2], "wb") as fh: pickle.dump(self.kept, fh)
            return {"kept": len(self.kept)}
        def abort(self, reason): self.aborted.append(reason)

    receiver = WeightReceiver(sys.argv[1], Keep())
    receiver.start()
    os.write(1, b"\\nbound\\n")  # one write: the receiver's own log lines share the pipe
    sys.stdin.read()  # until the test closes our stdin
    receiver.close()
""")


def _wait_bound(receiver: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the receiver writes its "bound" line, for `timeout` seconds at most. Its log
    lines share the pipe, from another thread too (a `print` of "bound" once had one land
    between the word and its newline), so the line is one os.write. A whole-suite run once
    hung here for 8 minutes with the receiver already past it: no read waits without a
    deadline."""
    assert receiver.stdout is not None
    fd = receiver.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    while b"\nbound\n" not in seen:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, left))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            raise AssertionError(f"the receiver never said bound: {seen[-500:]!r} "
                                 f"(exit {receiver.poll()})")  # fmt: skip
        seen += chunk


def test_transport_carries_every_tensor_between_processes_in_buckets(tmp_path: Path) -> None:
    address = socket_address(tmp_path, "shard")
    out = tmp_path / "kept.pkl"
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, address, str(out)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        _wait_bound(receiver, 60)
        torch.manual_seed(0)
        weights = [("a.weight", torch.randn(300)), ("b.bf16", torch.randn(7, 5).bfloat16()),
                   ("c.big", torch.randn(4000)),  # 16 KB: larger than a 4 KB bucket, alone
                   ("d.int", torch.arange(11)), ("e.half", torch.randn(3).half())]
        sender = WeightSender([address], bucket_bytes=4096, timeout_s=10)
        acks = sender.send(iter(weights), step=7)
        ack = acks[address]
        assert ack["step"] == 7 and ack["tensors"] == 5 and ack["kept"] == 5
        assert ack["digest"] == transfer_digest(weights)
        assert sender.buckets == 3 and sender.errors == {}  # a+b, c.big alone, d+e
        kept = pickle.loads(out.read_bytes())
        assert list(kept) == [n for n, _ in weights]
        for name, tensor in weights:
            assert kept[name].dtype == tensor.dtype and torch.equal(kept[name], tensor)
        # A changed value changes the digest: the acknowledgement can tell updates apart.
        changed = [(n, t.clone()) for n, t in weights]
        changed[0][1][0] += 1
        assert sender.send(iter(changed), step=8)[address]["digest"] != ack["digest"]
    finally:
        if receiver.stdin is not None:
            receiver.stdin.close()
        receiver.wait(timeout=10)


def test_transport_names_a_shard_that_does_not_answer(tmp_path: Path) -> None:
    nobody = socket_address(tmp_path, "nobody")
    seen: list[str] = []
    sender = WeightSender([nobody], bucket_bytes=4096, timeout_s=0.5)
    acks = sender.send(iter([("a", torch.ones(3)), ("b", torch.zeros(2))]), step=1,
                       tap=lambda name, _t: seen.append(name))
    assert acks == {}
    assert nobody in sender.errors and "begin" in sender.errors[nobody]
    assert seen == ["a", "b"]  # the checkpoint's copy still sees every tensor


# --------------------------------------------------------------------------- on the stack


def test_update_over_ipc_reaches_every_shard_and_is_published(stack: Dynamod) -> None:
    step = Client(stack.state_dir).policy_status()["current"] + 1
    expected = state_dict_digest(scaled(1.01))
    result = trainer_update(stack.state_dir, step, 1.01)
    assert result["acks"] == {"worker@0": expected, "worker@1": expected}
    assert result["stale"] == [] and result["errors"] == {}
    assert result["buckets"] > 1 and result["bytes"] == sum(
        t.numel() * t.element_size() for t in scaled(1.0).values())
    policy = Client(stack.state_dir).policy_status()
    assert policy["current"] == step and policy["current_digest"] == expected
    assert policy["history"][-1] == {"version": step, "path": result["checkpoint"],
                                     "how": "publish"}
    assert all(s["policy_version"] == step and s["admitted"] for s in policy["shards"])
    written = asyncio.run(ledger_revisions(stack))  # the shards' records in one write
    assert written["shards/worker@0"] == written["shards/worker@1"] > written["policy/current"]
    for shard in ("worker@0", "worker@1"):  # what each shard really holds
        held = engine(stack, shard, "get_weight_version")
        assert held["version"] == step and held["digest"] == expected
        assert held["model_path"] == f"ipc:step-{step}"
    served = completions(stack, step, 8)
    assert {(e["weight_version"], e["weight_digest"]) for e in served} == {(step, expected)}
    # Both shards serve the new step: one request pinned to each. (Which of two equal
    # shards the kv router picks for the 8 above is its own: in CI, under load, all 8
    # once went to one of them.)
    for shard in ("worker@0", "worker@1"):
        instance = unit_by_name(stack.status(), shard)["dynamo"]["instance_ids"][0]
        (pinned,) = completions(stack, step, 1, instance)
        assert int(pinned["instance_id"]) == instance, (shard, pinned)
        assert (pinned["weight_version"], pinned["weight_digest"]) == (step, expected)
    # The replay source: this step's checkpoint, written off the trainer's path.
    assert load_checkpoint(Path(result["checkpoint"])).digest == expected
    lines = (stack.state_dir / "verl" / "updates.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == step


def test_two_trainer_ranks_each_feed_their_shard_and_rank0_publishes(stack: Dynamod) -> None:
    """The GPU layout: trainer rank r colocated with shard r; rank 1 hands its
    acknowledgement to rank 0, which publishes the step for both."""
    step = Client(stack.state_dir).policy_status()["current"] + 1
    expected = state_dict_digest(scaled(1.015))
    ranks = [subprocess.Popen(trainer_command(stack.state_dir, step, 1.015, rank=r, world=2),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outputs = [p.communicate(timeout=180) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [err[-2000:] for _, err in outputs]
    rank0, rank1 = (json.loads(out.strip().splitlines()[-1]) for out, _ in outputs)
    assert rank1["acks"] == {"worker@1": expected}  # rank 1 fed worker@1 only
    assert rank0["acks"] == {"worker@0": expected, "worker@1": expected}
    assert rank0["stale"] == [] and rank0["publish"]["version"] == step
    for shard in ("worker@0", "worker@1"):
        assert engine(stack, shard, "get_weight_version")["digest"] == expected
    assert not (stack.state_dir / "verl" / "checkpoints" / "acks" / f"step-{step}").exists()


def test_shards_without_a_receiver_are_refused_with_what_to_set(stack: Dynamod,
                                                               tmp_path: Path) -> None:
    before = Client(stack.state_dir).policy_status()["current"]
    sync = ColocatedSync(stack.state_dir, tmp_path / "ckpt", tmp_path / "elsewhere")
    try:
        with pytest.raises(StackNotReadyError, match="worker_extension_cls and weight_ipc_dir"):
            asyncio.run(sync.update(iter([("w", torch.ones(2))]), before + 1))
    finally:
        sync.close()
    assert Client(stack.state_dir).policy_status()["current"] == before
    assert not (tmp_path / "ckpt").exists()


def test_a_shard_that_missed_the_update_is_held_and_replayed(stack: Dynamod) -> None:
    step = Client(stack.state_dir).policy_status()["current"] + 1
    expected = state_dict_digest(scaled(1.02))
    # worker@1's receiver becomes unreachable (its socket file gone): the update misses it.
    (stack.state_dir / "weight-ipc" / "worker@1.rank0.sock").unlink()
    # (the missing receiver fails at once; the timeout is the healthy shard's to answer)
    result = trainer_update(stack.state_dir, step, 1.02, timeout=10)
    assert result["acks"] == {"worker@0": expected}
    assert "worker@1" in result["errors"] and result["stale"] == ["worker@1"]
    # Only shards at the step serve the step's traffic while worker@1 catches up.
    assert {e["weight_version"] for e in completions(stack, step, 4)} == {step}
    stack.wait_for(
        lambda s: unit_by_name(s, "worker@1").get("policy_version") == step
        and "worker@1" not in s["policy"]["held"],
        timeout=90, what="worker@1 replayed to the published step from its checkpoint")
    held = engine(stack, "worker@1", "get_weight_version")
    assert held["version"] == step and held["digest"] == expected
    assert held["model_path"] == str(Path(result["checkpoint"]) / "model.safetensors")
    deadline, instances = time.monotonic() + 30, set()
    worker1 = set(unit_by_name(stack.status(), "worker@1")["dynamo"]["instance_ids"])
    while time.monotonic() < deadline and not instances & worker1:
        served = completions(stack, step, 4)
        assert {e["weight_digest"] for e in served} == {expected}
        instances |= {e["instance_id"] for e in served}
    assert instances & worker1, "the replayed shard never served the step's traffic"


def test_cpu_worker_refuses_an_extension_it_cannot_import() -> None:
    model = cache_dir() / "models" / "tiny-cpu"
    result = subprocess.run(
        [sys.executable, "-m", "dynamod.workers.cpu", "--model-path", str(model),
         "--worker-extension-cls", "nosuch.Extension"],
        env={**os.environ, "DYN_SYSTEM_PORT": "20001"}, capture_output=True, text=True,
        timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "dynamod.workers.cpu: error: --worker-extension-cls nosuch.Extension: cannot import it "
        "(No module named 'nosuch')"]
