"""A failed cluster test's report: ClusterRig.digest shows where the logs are and each
node's last warnings and cluster events, nothing else (no cluster is started here)."""

from __future__ import annotations

import json
from pathlib import Path

from dynamod.chaos.cluster import ClusterRig


def _log(path: Path, *records: dict[str, str]) -> None:
    path.mkdir(parents=True)
    lines = [json.dumps({"timestamp": "2026-12-06T18:14:01.145123Z", **r}) for r in records]
    (path / "daemon.log").write_text("\n".join([*lines, "not json"]) + "\n")


def test_the_digest_names_the_logs_and_keeps_warnings_and_cluster_events(tmp_path: Path) -> None:
    rig = ClusterRig(2, work_dir=tmp_path)
    _log(tmp_path / "head",
         {"event": "unit.state", "level": "info", "unit": "etcd"},
         {"event": "cluster.leader", "level": "info", "node": "head"},
         {"event": "dynamo.sweep_deferred", "level": "warning", "error": "refused"})  # fmt: skip
    lines = rig.digest().splitlines()
    assert lines[0] == f"the nodes' logs: {tmp_path}/<node>/daemon.log"
    assert lines[1:] == [
        "--- head: the last 2 of 2",
        "18:14:01.145 cluster.leader node=head",
        "18:14:01.145 dynamo.sweep_deferred error=refused",
        "--- n1: the last 0 of 0",  # its log not written yet
    ]
    assert rig.digest(last=1).splitlines()[1:3] == [
        "--- head: the last 1 of 2", "18:14:01.145 dynamo.sweep_deferred error=refused"
    ]
