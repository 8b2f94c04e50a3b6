"""verl's colocated weight path (`weight_sync: ipc`) on a cluster, for real: two network
namespaces as nodes, two CPU shards each hosting dynamod's worker extension; one trainer
rank per node sends the tiny model's tensors into its own node's shards over the IPC
transport (each node's dynamod lists only its own shards), rank 1 leaves its
acknowledgements beside the shared checkpoint, and rank 0 publishes the step on the head.
The head verifies its shards; n1's dynamod follows the ledger and admits the shard its rank
fed after checking its version and digest, without a load, and replays the checkpoint into
the shard that missed the update. Skipped, with the reason, where network namespaces cannot
be made."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamod.chaos.cluster import ClusterRig, running_cluster
from dynamod.chaos.netns import can_create_namespaces
from dynamod.workers.weights import load_checkpoint, state_dict_digest

REASON = can_create_namespaces()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
    pytest.mark.xdist_group("netns"),  # one simulated cluster at a time (make test runs -n 2)
]

EXTENSION = "dynamod.integrations.verl.worker_extension.DynamodWorkerExtension"

# one trainer rank: its node's state dir, the checkpoint folder every node reads, the step,
# the scale of the boot weights it sends, its rank, the world and the ranks on its node
TRAINER = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    from safetensors.torch import load_file
    from dynamod.core.paths import cache_dir
    from dynamod.integrations.verl.colocated import ColocatedSync

    state, shared, step, scale, rank, world, local = (
        Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]),
        int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]))
    boot = load_file(str(cache_dir() / "models" / "tiny-cpu" / "model.safetensors"))
    sync = ColocatedSync(state, shared, state / "weight-ipc", rank=rank, world=world,
                         local_world=local, bucket_bytes=64 << 10, timeout_s=60)
    result = asyncio.run(sync.update(((k, v * scale) for k, v in boot.items()), step))
    sync.close()
    print(json.dumps(result))
""")


@pytest.fixture(scope="module")
def rig() -> Iterator[ClusterRig]:
    variables = {"workers": "2", "trainer_steps": "0", "worker_extension_cls": EXTENSION,
                 "weight_ipc_dir": "{state_dir}/weight-ipc"}  # fmt: skip
    with running_cluster(2, variables=variables, timeout=300) as cluster:
        yield cluster


@pytest.fixture
def shared() -> Iterator[Path]:
    """The checkpoint folder every node reads (the replay source and the acks; here the
    nodes share one filesystem, on machines it is shared storage), removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="dmc-ckpt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _ranks(rig: ClusterRig, shared: Path, step: int,
           ranks: dict[str, tuple[int, int, float]]) -> dict[str, Any]:
    """Run one trainer rank inside each named node at once (node -> (rank, ranks on that
    node, the scale of the boot weights it sends)); every rank's last printed line, by
    node."""
    assert rig.sandbox is not None
    world = len(ranks)
    procs = {
        node: rig.sandbox.run(
            rig.names.index(node),
            [sys.executable, "-c", TRAINER, str(rig.state_dir(node)), str(shared), str(step),
             str(scale), str(rank), str(world), str(local)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        for node, (rank, local, scale) in ranks.items()
    }  # fmt: skip
    out = {}
    for node, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{node}: {stderr.decode(errors='replace')[-3000:]}"
        out[node] = json.loads(stdout.decode().strip().splitlines()[-1])
    return out


def _served_by(rig: ClusterRig, version: int, instance: int) -> int:
    """The instance that served a completion through the head's frontend that requires
    `version`'s taint and `instance`'s own (as dynamod's canary asks)."""
    body = json.dumps({
        "model": "tiny-cpu", "prompt": "which shard", "max_tokens": 1,
        "nvext": {"routing_constraints": {"required_taints": [
            f"dynamod.policy/{version}", f"dynamod.instance/{instance:x}"]},
            "extra_fields": ["worker_id"]},
    }).encode()  # fmt: skip
    request = urllib.request.Request(f"{rig.frontend_url()}/v1/completions", body,
                                     headers={"Content-Type": "application/json"})

    def ask() -> int:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return int(json.loads(answer.read())["nvext"]["worker_id"]["decode_worker_id"])

    return int(rig.in_node("head", ask))


def _shards(rig: ClusterRig, node: str) -> dict[str, dict[str, Any]]:
    return {u["name"]: u for u in rig.status(node)["units"] if u["name"].startswith("worker@")}


def test_each_node_s_rank_feeds_its_shards_and_the_other_node_verifies_them_unloaded(
    rig: ClusterRig, shared: Path
) -> None:
    """Rank 1 on n1 owns only n1's worker@1 (its share with two ranks on the node; the
    other rank's update failed, say): n1's worker@0 missed the step. The publish answers
    once n1 is at the step too; n1's fed shard was checked, not loaded, and its other one
    replayed the checkpoint, which verl's rank 0 wrote."""
    results = _ranks(rig, shared, step=1, ranks={"head": (0, 1, 1.5), "n1": (1, 2, 1.5)})
    head, n1 = results["head"], results["n1"]
    assert set(n1["acks"]) == {"n1/worker@1"} and not n1["errors"], n1
    published = head["publish"]
    assert set(head["acks"]) == {"head/worker@0", "head/worker@1", "n1/worker@1"}, head
    assert head["shards"] == ["head/worker@0", "head/worker@1"]  # its own node's, by ledger name
    assert len(set(head["acks"].values())) == 1 and not head["errors"], head
    digest = published["digest"]
    assert digest == next(iter(head["acks"].values()))
    # the head waited for n1: its answer names n1's shards at the step, none behind
    assert published["ok"] and published["stale"] == [], published
    assert published["nodes"] == {"n1": {"n1/worker@0": 1, "n1/worker@1": 1}}, published
    assert published["behind"] == []
    checkpoint = load_checkpoint(Path(head["checkpoint"])).tensors
    assert state_dict_digest(checkpoint) == digest  # what the replay loaded is what was sent

    for node in ("head", "n1"):
        for name, unit in _shards(rig, node).items():
            policy = unit["policy"]
            assert unit["policy_version"] == 1 and policy["digest"] == digest, (node, name)
            assert unit["state"] == "ready" and policy["admitted"], (node, name, unit)
    # the head's canaries proved its own shards routed; n1 has no frontend of its own, so
    # the head's router is asked here: the step's traffic reaches each of n1's shards
    for name, unit in _shards(rig, "head").items():
        assert unit["policy"]["routed_version"] == 1, (name, unit["policy"])
    for name, unit in _shards(rig, "n1").items():
        instance = unit["dynamo"]["instance_ids"][0]
        assert _served_by(rig, 1, instance) == instance, name
    fed, missed = (_shards(rig, "n1")[n]["policy"]["last_ack_ms"]
                   for n in ("worker@1", "worker@0"))  # fmt: skip
    assert "check" in fed and "load" not in fed, fed
    assert {"check", "load", "verify", "route"} <= set(missed), missed


def test_a_shard_fed_other_weights_on_its_node_is_replayed_from_the_checkpoint(
    rig: ClusterRig, shared: Path
) -> None:
    """n1's rank sends n1's worker@1 other weights than the head's rank sends the head's two
    shards: the ledger takes the two acknowledgements' digest, n1's worker@1 reports
    another, so n1's dynamod loads the checkpoint into it (and into worker@0, which missed
    the step) rather than admitting what it holds."""
    results = _ranks(rig, shared, step=2, ranks={"head": (0, 1, 1.25), "n1": (1, 2, 3.0)})
    head, n1 = results["head"], results["n1"]
    assert set(n1["acks"]) == {"n1/worker@1"}, n1
    published = head["publish"]
    assert published["ok"] and published["digest"] != n1["acks"]["n1/worker@1"], published
    assert published["nodes"] == {"n1": {"n1/worker@0": 2, "n1/worker@1": 2}}, published
    for name, unit in _shards(rig, "n1").items():
        policy = unit["policy"]
        assert unit["policy_version"] == 2 and policy["admitted"], (name, unit)
        assert policy["digest"] == published["digest"], (name, policy)
        assert {"check", "load"} <= set(policy["last_ack_ms"]), (name, policy)
