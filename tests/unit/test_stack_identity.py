"""A stack's identity (pure parts): where it comes from (`[stack] id`, the name, `--var
stack_id`), what derives from it (dynamod's keys, the stock units' Dynamo namespace), the
daemon key and its record, which live daemons a new one conflicts with, units outside the
stack (`--var etcd=HOST:PORT`), and the sweep's rule for a shared namespace."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamod.core import paths, spec
from dynamod.core.errors import SpecError, SpecErrors
from dynamod.rollout import identity, tables
from dynamod.rollout.etcd import EtcdPermissionDenied, KeyValue, prefix_range_end
from dynamod.rollout.identity import DaemonRecord, conflicts, daemon_key, is_daemon_key, sharers
from dynamod.rollout.ledger import lease_key, parse_lease_key
from dynamod.rollout.registrations import stale_leases


def load(path: Path, tmp_path: Path, **overrides: object) -> spec.Stack:
    tables.register()
    counter = itertools.count(40000)
    return spec.load(path, state_dir=tmp_path / "state", allocate_port=lambda: next(counter),
                     var_overrides=overrides)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(textwrap.dedent(text))
    return path


UNIT = """
[units.a]
command = ["sleep", "1"]
"""


def test_identity_is_the_name_then_stack_id_then_var(tmp_path: Path) -> None:
    named = write(tmp_path, '[stack]\nname = "my.stack"\n' + UNIT)
    assert load(named, tmp_path).identity == "my-stack"  # a namespace has no dots
    assert load(named, tmp_path, stack_id="b").identity == "b"
    given = write(tmp_path, '[stack]\nname = "s"\nid = "fixed"\n' + UNIT)
    assert load(given, tmp_path).identity == "fixed"
    assert load(given, tmp_path, stack_id=2).identity == "2"


@pytest.mark.parametrize("bad", ["a.b", "a/b", "", "x" * 65])
def test_a_bad_identity_is_refused_naming_the_field(tmp_path: Path, bad: str) -> None:
    path = write(tmp_path, UNIT)
    with pytest.raises(SpecErrors) as info:
        load(path, tmp_path, stack_id=bad)
    assert "stack identity" in str(info.value) and "--var" in str(info.value)
    header = write(tmp_path, f'[stack]\nid = "{bad}"\n' + UNIT)
    with pytest.raises(SpecError) as info:  # read from the file: refused before rendering
        load(header, tmp_path)
    assert "stack.id" in str(info.value)


def test_stock_stack_namespace_and_keys_derive_from_the_identity(tmp_path: Path) -> None:
    local = paths.units_dir() / "stacks" / "local.toml"
    for stack_id in ("local", "beta"):
        stack = load(local, tmp_path, **({} if stack_id == "local" else {"stack_id": stack_id}))
        assert identity.namespaces(stack) == (stack_id,)
        assert stack.units["frontend"].env["DYN_NAMESPACE"] == stack_id
        assert daemon_key(stack.identity) == f"dynamod/{stack_id}/daemon"
        assert lease_key(stack.identity, None, "worker@0") == f"dynamod/{stack_id}/leases/worker@0"


def test_outside_etcd_and_nats_are_waited_for_not_started(tmp_path: Path) -> None:
    local = paths.units_dir() / "stacks" / "local.toml"
    stack = load(local, tmp_path, etcd="127.0.0.1:2379", nats="10.0.0.5:4222", stack_id="b")
    etcd, nats = stack.units["etcd"], stack.units["nats"]
    assert etcd.outside == "127.0.0.1:2379" and etcd.remote == "127.0.0.1:2379"
    assert nats.outside == "10.0.0.5:4222" and nats.depends_on == {}
    assert etcd.ready is not None and etcd.ready.kind == "tcp"
    worker = stack.units["worker@0"]
    assert worker.env["ETCD_ENDPOINTS"] == "http://127.0.0.1:2379"
    assert worker.env["NATS_SERVER"] == "nats://10.0.0.5:4222"
    assert identity.stack_etcd(stack) == "http://127.0.0.1:2379"
    own = load(local, tmp_path)
    assert own.units["etcd"].outside is None and own.units["etcd"].remote is None


@pytest.mark.parametrize("bad", ["nohost", "host:", ":2379", "host:99999", "host:port"])
def test_a_bad_outside_address_names_the_unit_and_field(tmp_path: Path, bad: str) -> None:
    local = paths.units_dir() / "stacks" / "local.toml"
    with pytest.raises(SpecErrors) as info:
        load(local, tmp_path, etcd=bad)
    assert "unit 'etcd'" in str(info.value) and "'outside'" in str(info.value)
    assert "HOST:PORT" in str(info.value)


def record(**kw: object) -> DaemonRecord:
    base: dict[str, object] = dict(id="a", stack="local", host="elsewhere", pid=1,
                                   state_dir="/s/a", run_id="r1", namespaces=("a",))
    return DaemonRecord(**{**base, **kw})  # type: ignore[arg-type]


def test_the_daemon_record_round_trips_and_foreign_values_are_ignored() -> None:
    held = record(node="n1", lease=77)
    again = DaemonRecord.decode(held.encode())
    assert again == held and again is not None and again.lease == 0  # the lease is etcd's
    assert DaemonRecord.decode(b"not json") is None
    assert DaemonRecord.decode(b'{"id": "a"}') is None
    assert is_daemon_key(daemon_key("a")) and is_daemon_key(daemon_key("a", "n1"))
    for key in ("dynamod/a/leases/w@0", "dynamod/a/policy/current", "dynamod/daemon",
                "other/a/daemon"):  # fmt: skip
        assert not is_daemon_key(key), key
    assert parse_lease_key(daemon_key("a")) is None  # no lease record either


class SortedStore:
    """etcd's key order and its two reads `live_daemons` makes, over a dict; it counts
    what each read returned (a pure model of etcd, for the scan's logic alone: the real
    etcd is in tests/integration/test_etcd_client.py)."""

    def __init__(self, kvs: dict[str, bytes]) -> None:
        self.kvs = dict(sorted(kvs.items(), key=lambda kv: kv[0].encode()))
        self.values_read = 0
        self.first_keys = 0

    async def first_key(self, start: str, prefix: str) -> str | None:
        self.first_keys += 1
        end = prefix_range_end(prefix)
        keys = (k for k in self.kvs if start.encode() <= k.encode() < end)
        return next(keys, None)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        got = [KeyValue(k, v, 7, 1) for k, v in self.kvs.items() if k.startswith(prefix)]
        self.values_read += len(got)
        return got


def read_all(kvs: dict[str, bytes]) -> list[DaemonRecord]:
    """What `live_daemons` read before: every key under dynamod/, filtered."""
    found = [DaemonRecord.decode(v) for k, v in kvs.items() if is_daemon_key(k)]
    return [replace(r, lease=7) for r in found if r is not None]


SEGMENT = st.text(alphabet="ab-./0_", min_size=1, max_size=3)


@given(
    st.dictionaries(
        st.one_of(
            st.tuples(SEGMENT, st.sampled_from([None, "n1", "n2"])).map(
                lambda t: daemon_key(*t)
            ),
            st.lists(SEGMENT, min_size=1, max_size=4).map(lambda p: "dynamod/" + "/".join(p)),
            st.sampled_from(["dynamod/", "dynamod0", "dynamo/x", "other/a/daemon"]),
        ),
        st.sampled_from([record().encode().encode(), record(node="n1").encode().encode(), b"x"]),
        max_size=40,
    )
)
def test_live_daemons_reads_each_stack_folders_daemon_keys_and_finds_every_one(
    kvs: dict[str, bytes],
) -> None:
    store = SortedStore(kvs)
    found = asyncio.run(identity.live_daemons(store))
    key = lambda r: (r.id, r.node or "", r.encode())  # noqa: E731
    assert sorted(found, key=key) == sorted(read_all(store.kvs), key=key)
    daemons = [k for k in kvs if k.startswith("dynamod/") and "/daemon" in k]
    assert store.values_read <= len(daemons)  # no stack's other records
    folders = {k.split("/")[1] for k in kvs if k.startswith("dynamod/") and k.count("/") >= 2}
    assert store.first_keys <= len(folders) + len(kvs) + 1


def test_live_daemons_skips_a_fleets_records_whole() -> None:
    kvs = {daemon_key("a", f"n{i}"): record(node=f"n{i}").encode().encode() for i in range(8)}
    for i, j in itertools.product(range(8), range(32)):
        kvs[f"dynamod/a/cluster/units/n{i}/shard-{j}"] = b"u"
        kvs[f"dynamod/a/shards/n{i}.shard-{j}"] = b"s"
    kvs[daemon_key("b")] = record(id="b").encode().encode()
    kvs["dynamod/b/policy/current"] = b"{}"
    store = SortedStore(kvs)
    found = asyncio.run(identity.live_daemons(store))
    assert sorted((r.id, r.node) for r in found) == [("a", f"n{i}") for i in range(8)] + [
        ("b", None)
    ]
    assert store.values_read == 9 and store.first_keys == 3  # a, b, then none past b


class AuthStore(SortedStore):
    """etcd's auth as a stack's role has it: its own folder readable, a read of anything
    wider refused whole."""

    def __init__(self, kvs: dict[str, bytes], own: str) -> None:
        super().__init__(kvs)
        self.own = f"dynamod/{own}/"

    def _check(self, prefix: str) -> None:
        if not prefix.startswith(self.own):
            raise EtcdPermissionDenied("http://e", "get_prefix", prefix, "denied", "e")

    async def first_key(self, start: str, prefix: str) -> str | None:
        self._check(prefix)
        return await super().first_key(start, prefix)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        self._check(prefix)
        return await super().get_prefix(prefix)


def test_under_etcd_auth_the_look_finds_its_own_identity_and_says_the_rest_is_hidden() -> None:
    kvs = {daemon_key("a", n): record(node=n).encode().encode() for n in ("n1", "n2")}
    kvs[daemon_key("b")] = record(id="b").encode().encode()
    found = asyncio.run(identity.look(AuthStore(kvs, "a"), "a"))
    assert sorted(r.node or "" for r in found.daemons) == ["n1", "n2"] and found.others_hidden
    with pytest.raises(EtcdPermissionDenied):  # the whole look is refused, as etcd does
        asyncio.run(identity.live_daemons(AuthStore(kvs, "a")))
    # without auth: every stack's, nothing hidden
    seen = asyncio.run(identity.look(SortedStore(kvs), "a"))
    assert len(seen.daemons) == 3 and not seen.others_hidden
    # a second copy of a node is still refused under auth: the look sees its own identity
    me = record(node="n1", run_id="", host="here", state_dir="/s/other")
    assert conflicts(me, found.daemons) != []


def test_a_second_copy_of_a_held_identity_is_refused_naming_the_holder() -> None:
    me = record(run_id="", state_dir="/s/b", host="here")
    problems = conflicts(me, [record(pid=4242)])
    assert len(problems) == 1
    assert "stack identity 'a' is held by a live daemon" in problems[0]
    assert "pid 4242 on host elsewhere, state dir /s/a" in problems[0]
    assert "--var stack_id=" in problems[0]


def test_other_identities_pass_unless_they_use_our_namespace() -> None:
    me = record(run_id="", id="b", namespaces=("b",), host="here")
    assert conflicts(me, [record()]) == []
    shared = conflicts(me, [record(namespaces=("b", "x"))])
    assert len(shared) == 1 and "Dynamo namespace 'b' is used by the workers of" in shared[0]
    assert sharers(me, [record(namespaces=("b",)), record(id="c", namespaces=("z",))]) == {
        "b": [record(namespaces=("b",))]
    }


def test_another_node_of_a_cluster_stack_is_no_conflict() -> None:
    me = record(run_id="", node="n2", host="here")
    assert conflicts(me, [record(node="n1")]) == []
    assert conflicts(me, [record(node="n2")]) != []


def test_a_single_node_stack_and_a_cluster_of_one_identity_conflict() -> None:
    """Their daemon keys differ (`dynamod/a/daemon` and `dynamod/a/daemon/head`), their
    ledger would not: whichever comes second is refused, naming the holder."""
    head = record(stack="cluster", node="head", state_dir="/s/head")
    single = conflicts(record(run_id="", host="here", state_dir="/s/b"), [head])
    assert len(single) == 1 and "stack identity 'a' is held by a live daemon" in single[0]
    assert "node head" in single[0] and "state dir /s/head" in single[0]
    node = record(run_id="", stack="cluster", node="n1", host="here")
    assert conflicts(node, [record()]) != []  # a cluster node beside a single-node stack
    assert conflicts(node, [record(stack="other", node="n2")]) != []  # another cluster stack
    assert conflicts(node, [record(stack="cluster", node="n2")]) == []  # its own cluster


def test_two_cluster_stacks_of_one_name_and_other_identities_conflict() -> None:
    """A node registry lives under the stack's name (`dynamod/<name>/cluster/`): a second
    cluster stack of that name on the same etcd is refused though its identity differs;
    a cluster of another name, or a single-node stack of the same name, is not."""
    head = record(stack="cluster", node="head", namespaces=("x",))
    copy = record(run_id="", id="b", stack="cluster", node="head", host="here",
                  namespaces=("y",))  # fmt: skip
    [problem] = conflicts(copy, [head])
    assert "keeps its node registry under dynamod/cluster/cluster/" in problem, problem
    assert "pid 1 on host elsewhere" in problem and "[stack] name" in problem
    assert conflicts(replace(copy, stack="other"), [head]) == []
    assert conflicts(replace(copy, node=None), [head]) == []


def test_up_of_a_cluster_node_looks_for_a_live_holder_of_that_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tables.register()
    counter = itertools.count(40000)

    def node(name: str) -> spec.Stack:
        return spec.load(paths.units_dir() / "stacks" / "cluster.toml", state_dir=tmp_path,
                         allocate_port=lambda: next(counter), node=name)  # fmt: skip

    live = [record(id="cluster", stack="cluster", node=n, state_dir=f"/s/{n}", pid=7)
            for n in ("head", "n2")]  # fmt: skip
    asked: list[str] = []

    def look(endpoint: str, auth: object, own: str) -> list[DaemonRecord]:
        asked.append(endpoint)
        assert own == "cluster"  # its own identity: what a look under etcd's auth can read
        return live

    monkeypatch.setattr(identity, "_look_in_child", look)
    n2 = node("n2")
    with pytest.raises(identity.IdentityTaken) as info:
        identity.check_before_up(n2, str(tmp_path / "copy"))
    assert asked == [identity.stack_etcd(n2)] == ["http://10.77.0.1:2379"]
    assert "identity 'cluster' node n2" in str(info.value) and "/s/n2" in str(info.value)
    identity.check_before_up(node("n1"), str(tmp_path / "n1"))  # a node nobody holds
    assert len(asked) == 2


def test_a_key_left_by_a_gone_daemon_of_this_host_is_no_conflict() -> None:
    host = socket.gethostname()
    me = record(run_id="", host=host, state_dir="/s/mine")
    dead = 2**22 + 12345  # above pid_max's default: no such process
    assert conflicts(me, [record(host=host, pid=dead)]) == []
    # the same state dir: its lock says the earlier daemon is gone, whatever its pid
    assert conflicts(me, [record(host=host, pid=os.getpid(), state_dir="/s/mine")]) == []
    # alive on this host in another state dir: a real holder
    assert conflicts(me, [record(host=host, pid=os.getpid())]) != []


def test_the_sweep_leaves_unrecorded_registrations_alone_in_a_shared_namespace() -> None:
    # 1: ours (recorded, dead); 3: recorded by no stack; 7: another stack's record
    assert stale_leases({1, 3, 7}, ours={1}, others={7}) == {1, 3}
    assert stale_leases({1, 3, 7}, ours={1}, others={7}, shared=True) == {1}


def test_status_shows_a_shared_namespace_as_degraded_with_the_count() -> None:
    from dynamod.control.render import identity_lines

    other = record(id="b", namespaces=("a",)).describe()
    lines = identity_lines({"shared_namespaces": {"a": {"stacks": [other], "workers": 2}}})
    assert lines == [f"degraded: Dynamo namespace 'a' is shared with 2 worker(s) of {other} "
                     "(the frontends of both stacks may route to the other's workers)"]
    assert identity_lines({"shared_namespaces": {}, "refused": None}) == []
    assert identity_lines({"refused": "taken"}) == ["identity not held: taken"]
    # etcd's auth hid the other stacks: no sharing can be seen, and status says so
    assert identity_lines({"shared_namespaces": {}, "others_visible": True}) == []
    hidden = identity_lines({"shared_namespaces": {}, "others_visible": False})
    assert len(hidden) == 1 and "hidden from this stack's etcd user" in hidden[0], hidden
    assert "not detected" in hidden[0]


def test_exports_start_no_unit_that_runs_outside_the_stack(tmp_path: Path) -> None:
    from dynamod.ops import systemd
    from dynamod.ops.supervisord import supervisord_config

    local = paths.units_dir() / "stacks" / "local.toml"
    outside = load(local, tmp_path, etcd="127.0.0.1:2379", nats="127.0.0.1:4222")
    own = load(local, tmp_path)
    config = supervisord_config(outside, state_dir=tmp_path / "sv")
    assert "[program:etcd]" not in config and "[program:nats]" not in config
    assert "[program:worker-0]" in config and "[program:frontend]" in config
    assert "[program:etcd]" in supervisord_config(own, state_dir=tmp_path / "sv")
    names = [f.name for f in systemd.per_unit_services(outside, dynamod=["dynamod"])]
    assert systemd.service_name("etcd") not in names and systemd.service_name("nats") not in names
    worker = next(f for f in systemd.per_unit_services(outside, dynamod=["dynamod"])
                  if f.name == systemd.service_name("worker@0"))
    assert systemd.service_name("etcd") not in worker.text
    assert systemd.service_name("etcd") in [
        f.name for f in systemd.per_unit_services(own, dynamod=["dynamod"])]
