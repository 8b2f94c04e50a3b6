"""Pure logic of the spare pool: which spare is promoted, which role a shard gets, and
what taints a role carries. The manager is a stand-in holding only the facts these read."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dynamod.rollout.shard_driver import ShardPolicy
from dynamod.rollout.spares import Candidate, Reason, Role, SparePool, choose


def test_choose_prefers_awake_and_current_then_behind_then_asleep() -> None:
    awake_current = Candidate("w@2", 3, asleep=False)
    awake_behind = Candidate("w@1", 2, asleep=False)
    asleep_current = Candidate("w@0", 3, asleep=True)
    assert choose([asleep_current, awake_behind, awake_current], current=3) == "w@2"
    assert choose([asleep_current, awake_behind], current=3) == "w@1"
    assert choose([asleep_current], current=3) == "w@0"
    assert choose([], current=3) is None


def pool(shards: int, spares: int) -> tuple[SparePool, list[Any]]:
    units = [SimpleNamespace(name=f"w@{i}", extra={}, state="held") for i in range(shards + spares)]
    engine = SimpleNamespace(
        units={u.name: u for u in units}, transition=lambda unit, state, detail: None
    )
    manager = SimpleNamespace(
        shard_names={u.name for u in units},
        spec=SimpleNamespace(taint_prefix="dynamod.policy/"),
        engine=engine,
        current_version=4,
        shard_policy=lambda unit: ShardPolicy(),
    )
    return SparePool(manager, spares), units  # type: ignore[arg-type]


def test_first_shards_ready_serve_the_rest_are_spares() -> None:
    spares, units = pool(shards=2, spares=1)
    assert [spares.assign(u) for u in units] == [Role.SERVING, Role.SERVING, Role.SPARE]
    assert spares.taints(units[0], 4) == ["dynamod.policy/4"]
    assert spares.taints(units[2], 4) == [], "a spare must carry no policy taint"
    assert not spares.is_serving(units[2]) and spares.is_spare(units[2])


def test_no_spares_configured_every_shard_serves_as_today() -> None:
    spares, units = pool(shards=3, spares=0)
    assert {spares.assign(u) for u in units} == {Role.SERVING}
    assert all(spares.taints(u, 4) == ["dynamod.policy/4"] for u in units)
    assert spares.summary()["spares"] == [] and spares.summary()["wanted"] == 0


def test_status_tree_shows_a_ready_spare_as_its_own_role() -> None:
    from dynamod.control.render import _state

    assert _state({"state": "ready", "spare": {"role": "spare", "sleeping": False}}) == "spare"
    assert _state({"state": "ready", "spare": {"role": "spare", "sleeping": True}}) == (
        "spare (asleep)"
    )
    assert _state({"state": "ready", "spare": {"role": "serving"}}) == "ready"
    assert _state({"state": "held", "spare": {"role": "spare"}}) == "held"  # catching up
    assert _state({"state": "ready"}) == "ready"


def test_a_lost_shard_is_swapped_for_the_spare_once_and_its_exit_promotes_no_other() -> None:
    import asyncio

    async def scenario() -> None:
        spares, units = pool(shards=3, spares=1)
        for u in units:
            u.state = SimpleNamespace(running=True)
            u.hold_reason = None
        spares.driver.engine.stopping = False
        roles = [spares.assign(u) for u in units]
        assert roles == [Role.SERVING, Role.SERVING, Role.SERVING, Role.SPARE]
        spares._promote = lambda *a: asyncio.sleep(0)  # type: ignore[method-assign]
        hung, spare = units[0], units[3]
        spares.driver.shard_names = {u.name for u in units}
        spares.on_lost(hung, "liveness failed 3 times in a row")
        assert spares.role(spare) is Role.PROMOTING, "the spare was not promoted on the loss"
        assert spares.role(hung) is Role.SPARE, "the lost shard still counts as serving"
        spares.lost(hung, Reason.EXIT, "killed by signal 9")  # the kill that follows
        promoting = [n for n, s in spares.slots.items() if s.role is Role.PROMOTING]
        assert promoting == [spare.name], "its exit promoted a second time"
        await spares.stop()

    asyncio.run(scenario())
