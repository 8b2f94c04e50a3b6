"""Each unit's row in `status`: the engine's keys, then each extension's own, reported by
`Extension.unit_status` from a typed record the extension keeps. No extension can
overwrite the engine's keys (`state`, `pid`) or another extension's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dynamod.core.daemon import Daemon
from dynamod.core.extensions import Extension
from dynamod.core.status import ExtensionUnitStatus
from dynamod.rollout.registrations import Registration
from dynamod.rollout.shard_driver import ShardAck, ShardPolicy

ROW = {"name": "worker@0", "state": "ready", "pid": 42, "detail": "serving"}


class Greedy(Extension):
    def unit_status(self, unit: Any) -> ExtensionUnitStatus:
        taken: Any = {"state": "hijacked", "pid": 1, "policy_version": 7}
        return taken  # what the types forbid, tried at run time


class Second(Extension):
    def unit_status(self, unit: Any) -> ExtensionUnitStatus:
        return {"policy_version": 9, "dynamo": Registration("ns", "http://w", [10]).as_status()}


def rows(*extensions: Extension) -> list[Any]:
    daemon = Daemon(stack=SimpleNamespace(name="s"), state=SimpleNamespace(path=Path("/x")),  # type: ignore[arg-type]
                    extensions=list(extensions))  # fmt: skip
    daemon.engine = SimpleNamespace(  # type: ignore[assignment]
        snapshot=lambda: [dict(ROW)], units={"worker@0": SimpleNamespace(name="worker@0")}
    )
    return daemon.unit_rows()  # type: ignore[return-value]


def test_an_extension_cannot_overwrite_the_engines_keys_or_another_extensions() -> None:
    [row] = rows(Greedy(), Second())
    assert row["state"] == "ready" and row["pid"] == 42, "an extension overwrote the engine's"
    assert row["policy_version"] == 7, "a later extension overwrote an earlier one's key"
    assert row["dynamo"]["instance_ids"] == [10]


def test_without_extensions_a_row_is_the_engines() -> None:
    assert rows() == [ROW]


def test_policy_version_appears_once_the_shard_acknowledged_one_or_exited() -> None:
    shard = ShardPolicy(current=3)
    assert "policy_version" not in shard.as_status(), "a shard on its first catch-up has none"
    assert shard.as_status()["policy"]["current"] == 3
    shard.acknowledged(ShardAck("worker@0", 3, "d1", {"load": 12.34}), current=3, admitted=True)
    status = shard.as_status()
    assert status["policy_version"] == 3 and status["policy"]["version"] == 3
    assert status["policy"]["admitted"] and status["policy"]["last_ack_ms"] == {"load": 12.3}
    shard.exited()
    status = shard.as_status()
    assert "policy_version" in status and status["policy_version"] is None
    assert not status["policy"]["admitted"] and status["policy"]["digest"] == "d1"
