"""The stock replicated stack (units/stacks/cluster-ha.toml) renders on every node with every
etcd member as its endpoints and no secret on a command line; etcd endpoint lists are
checked element by element; the `etcd-login` wait stops at a refusal and retries anything
else until its time is spent (pure: etcdctl replaced)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dynamod.cluster import etcd_auth
from dynamod.control.cliutil import load_stack
from dynamod.rollout.policy_table import PolicySpec, policy_of
from dynamod.rollout.worker_table import worker_of
from tests import cli_inprocess

STACKS = Path(__file__).resolve().parents[2] / "units" / "stacks"
NODES = "head=10.77.0.1,n1=10.77.0.2,n2=10.77.0.3"


def test_etcd_endpoint_lists_are_checked_one_by_one() -> None:
    ok = PolicySpec(etcd="https://10.0.0.1:2379,https://10.0.0.2:2379", shards=["w"])
    assert ok.etcd == "https://10.0.0.1:2379,https://10.0.0.2:2379"
    for bad in ("https://10.0.0.1:2379,", "https://10.0.0.1:2379,etcd:2379", "x,https://a:1"):
        with pytest.raises(ValidationError):
            PolicySpec(etcd=bad, shards=["w"])


def test_every_node_renders_with_all_members_and_no_secret_in_argv(tmp_path: Path) -> None:
    stack = tmp_path / "cluster-ha.toml"
    text = (STACKS / "cluster-ha.toml").read_text().replace('"../', f'"{STACKS.parent}/')
    stack.write_text(text)
    made = cli_inprocess.run(["secrets", "init", str(tmp_path / "cluster-ha.secrets"),
                              "--nodes", NODES])  # fmt: skip
    assert made.code == 0, made.stderr
    creds = json.loads((tmp_path / "cluster-ha.secrets" / "credentials.json").read_text())
    secrets = [v for k, v in creds.items() if "password" in k]
    members = ",".join(f"https://10.77.0.{i}:2379" for i in (1, 2, 3))
    for node in ("head", "n1", "n2"):
        resolved = load_stack(str(stack), tmp_path / node, (), node)
        units = resolved.units
        assert ("etcd-auth" in units) == (node == "head") and "etcd-login" in units
        worker = units["worker@0"]
        # Dynamo reaches etcd through the node's proxy, which has every member behind it
        assert worker.env["ETCD_ENDPOINTS"] == "https://127.0.0.1:23790"
        assert worker.depends_on["etcd-relay"] == "ready"
        if node == "head":
            assert units["frontend"].env["ETCD_ENDPOINTS"] == "https://127.0.0.1:23790"
        relay = units["etcd-relay"].command
        assert relay[relay.index("--members") + 1] == members
        dynamo = worker_of(worker)
        assert dynamo is not None
        assert dynamo.etcd == members and worker.depends_on["etcd-login"] == "completed"
        policy = policy_of(resolved)
        assert policy is not None and policy.etcd == members
        assert resolved.cluster is not None and len(resolved.cluster.registry) == 3
        rendered = [" ".join(u.command) + repr(sorted(u.env.items())) for u in units.values()]
        assert not [s for s in secrets for text in rendered if s in text], node

def _fake_run(answers: list[Exception | str]) -> Any:
    calls: list[int] = []

    def run(*_: Any, **__: Any) -> str:
        calls.append(1)
        answer = answers[min(len(calls), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    run.calls = calls  # type: ignore[attr-defined]
    return run


def test_login_wait_retries_until_auth_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_run([etcd_auth.EtcdAuthError("authentication is not enabled")] * 2 + ["ok"])
    monkeypatch.setattr(etcd_auth, "run", fake)
    monkeypatch.setattr(etcd_auth.time, "sleep", lambda _: None)
    assert etcd_auth.run_until([], None, "n1", "s", wait_s=10, binary="etcdctl") == "ok"  # type: ignore[arg-type]
    assert len(fake.calls) == 3


def test_login_wait_stops_at_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_run([etcd_auth.EtcdRefusal("refused user 'dynamod': authentication failed")])
    monkeypatch.setattr(etcd_auth, "run", fake)
    monkeypatch.setattr(etcd_auth.time, "sleep", lambda _: None)
    with pytest.raises(etcd_auth.EtcdRefusal):
        etcd_auth.run_until([], None, "n1", "s", wait_s=10, binary="etcdctl")  # type: ignore[arg-type]
    assert len(fake.calls) == 1


def test_login_wait_gives_up_when_its_time_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_run([etcd_auth.EtcdAuthError("no member answered")])
    monkeypatch.setattr(etcd_auth, "run", fake)
    monkeypatch.setattr(etcd_auth.time, "sleep", lambda _: None)
    with pytest.raises(etcd_auth.EtcdAuthError, match=r"checked for 0\.5 s"):
        etcd_auth.run_until([], None, "n1", "s", wait_s=0.5, binary="etcdctl")  # type: ignore[arg-type]


def test_only_a_taint_write_that_dynamos_etcd_client_failed_is_sent_again() -> None:
    from dynamod.rollout.policy import is_transient_etcd_failure

    said = ('HTTP 500: {"message":"Python callback failed: Exception: Internal etcd error: '
            'grpc request error: ... KeepAliveTimedOut"}')  # fmt: skip
    assert is_transient_etcd_failure("update/model_taints", said)
    assert not is_transient_etcd_failure("update_weights_from_disk", said)
    assert not is_transient_etcd_failure("update/model_taints", "HTTP 500: bad taint name")


def test_a_transient_taint_write_is_sent_again_for_its_time_budget_then_given_up() -> None:
    from dynamod.rollout.policy import send_again

    said = ('HTTP 500: {"message":"Python callback failed: Exception: Internal etcd error: '
            'grpc request error: ... tcp connect error ... Connection reset by peer"}')  # fmt: skip
    assert send_again("update/model_taints", said, 0.0)
    assert send_again("update/model_taints", said, 9.9)  # many quick failures in a row
    assert not send_again("update/model_taints", said, 10.0)
    assert not send_again("update/model_taints", "HTTP 500: bad taint name", 0.0)
