"""Pure logic of the spare pool: which spare is promoted, which role a shard gets, and
what taints a role carries. The manager is a stand-in holding only the facts these read."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dynamod.rollout.shard_driver import ShardPolicy
from dynamod.rollout.spares import Candidate, Reason, Role, SparePool, choose, rebalanced


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


def test_rebalanced_promotes_spares_when_short_and_makes_the_last_serving_ones_spares() -> None:
    S, P, X = Role.SERVING, Role.PROMOTING, Role.SPARE
    order = ["w@0", "w@1", "w@2", "w@3"]
    # short by 2, one spare there: one promotion, no more than the spares
    assert rebalanced({"w@0": S, "w@1": X}, order, wanted=3) == (1, [])
    assert rebalanced({"w@0": S, "w@1": X, "w@3": X}, order, wanted=3) == (2, [])
    # a promotion under way serves already; a shard with no role yet counts as neither
    assert rebalanced({"w@0": S, "w@1": P, "w@2": X}, order, wanted=2) == (0, [])
    # over by 2: the last serving ones in start order become spares, never a promoting one
    over = {"w@0": S, "w@1": S, "w@2": P, "w@3": S}
    assert rebalanced(over, order, wanted=2) == (0, ["w@3", "w@1"])
    assert rebalanced({"w@0": S, "w@1": S, "w@2": X}, order, wanted=2) == (0, [])
    assert rebalanced({}, order, wanted=2) == (0, [])


class Driver:
    """The manager as the pool sees it: shards, their records, and the calls made."""

    def __init__(self, units: list[Any]) -> None:
        import asyncio

        self.engine = SimpleNamespace(
            units={u.name: u for u in units}, transition=lambda *a: None, stopping=False
        )
        self.shard_names = {u.name for u in units}
        self.spec = SimpleNamespace(taint_prefix="dynamod.policy/")
        self.current_version = 4
        self.lock = asyncio.Lock()
        self.calls: list[tuple[str, str, Any]] = []
        self.acks: list[tuple[str, int]] = []
        self.events: list[tuple[str, str | None]] = []

    def shard_policy(self, unit: Any) -> ShardPolicy:
        return ShardPolicy(version=4, digest="d4")

    def routing_taints(self, unit: Any, version: int) -> tuple[list[str], list[str]]:
        return [], [f"dynamod.instance/{unit.name}"]

    async def call(self, unit: Any, route: str, payload: Any) -> dict[str, Any]:
        self.calls.append((unit.name, route, payload))
        return {"status": "ok"}

    async def record_ack(self, unit: Any, ack: Any) -> None:
        self.acks.append((unit.name, ack.version))

    def event(self, kind: str, unit: str | None, **fields: Any) -> None:
        self.events.append((kind, unit))

    def note_error(self, unit: Any, error: str) -> None:
        raise AssertionError(error)


def live_pool(names: int, spares: int) -> tuple[SparePool, Driver, list[Any]]:
    import asyncio

    units = [SimpleNamespace(name=f"w@{i}", pid=None, hold_reason=None,
                             state=SimpleNamespace(running=True)) for i in range(names)]
    driver = Driver(units)
    pool_ = SparePool(driver, spares)  # type: ignore[arg-type]
    promoted: list[str] = []

    async def promote(unit: Any, slot: Any, *args: Any) -> None:
        promoted.append(unit.name)
        slot.role = Role.SERVING
        await asyncio.sleep(0)

    pool_._promote = promote  # type: ignore[assignment]
    pool_._keep_current = lambda unit: None  # type: ignore[method-assign]
    driver.promoted = promoted  # type: ignore[attr-defined]
    return pool_, driver, units


def test_apply_of_a_new_spares_count_gives_added_shards_the_right_role_and_rebalances() -> None:
    import asyncio

    async def scenario() -> None:
        # up with 2 shards, no spares; apply `spares = 1`: a third instance is added
        pool_, driver, units = live_pool(3, spares=0)
        driver.shard_names = {"w@0", "w@1"}
        assert [pool_.assign(u) for u in units[:2]] == [Role.SERVING, Role.SERVING]
        driver.shard_names = {"w@0", "w@1", "w@2"}
        pool_.resize(1)
        assert pool_.count == 1 and not driver.calls, "nothing to rebalance before it is ready"
        assert pool_.assign(units[2]) is Role.SPARE, "the added instance must be the spare"
        assert pool_.taints(units[2], 4) == []

        # apply `spares = 0` with the instance kept (workers 2 -> 3): the spare serves
        pool_.resize(0)
        await asyncio.sleep(0.01)
        assert driver.promoted == ["w@2"] and pool_.is_serving(units[2])  # type: ignore[attr-defined]

        # `spares = 1` of the same 3 (workers 3 -> 2): the last serving one becomes the
        # spare, out of the push set at once, its version taint dropped, its ack kept
        pool_.resize(1)
        assert pool_.is_spare(units[2]) and pool_.is_serving(units[0])
        await asyncio.sleep(0.01)
        assert driver.calls == [("w@2", "update/model_taints",
                                 {"taints": ["dynamod.instance/w@2"]})]
        assert driver.acks == [("w@2", 4)] and ("spares.demoted", "w@2") in driver.events
        await pool_.stop()

    asyncio.run(scenario())


def test_a_removed_serving_shard_is_replaced_before_it_goes_and_its_exit_promotes_none() -> None:
    import asyncio

    from dynamod.core.restart import Exit

    async def scenario() -> None:
        # 2 serving + 1 spare; after a promotion w@0 is the spare and w@2 serves. An apply
        # of `spares = 0` removes w@2 (the highest index): w@0 must serve before it goes.
        pool_, driver, units = live_pool(3, spares=1)
        for u in units:
            pool_.assign(u)
        pool_.slots["w@0"].role, pool_.slots["w@2"].role = Role.SPARE, Role.SERVING
        await pool_.fill(["w@0", "w@1"], wanted=2, leaving={"w@2"}, timeout=5)
        assert driver.promoted == ["w@0"]  # type: ignore[attr-defined]
        assert pool_.is_serving(units[0]) and pool_.is_serving(units[1])

        pool_.retire("w@2")  # drained: out of the pool before it stops
        await pool_.on_exit(units[2], Exit(code=0, signal=None))
        await asyncio.sleep(0.01)
        assert driver.promoted == ["w@0"], "its stop promoted another shard"  # type: ignore[attr-defined]
        driver.shard_names = {"w@0", "w@1"}
        del driver.engine.units["w@2"]
        pool_.resize(0)
        assert set(pool_.slots) == {"w@0", "w@1"} and "w@2" not in pool_.promotions
        assert pool_.summary()["spares"] == [] and not driver.calls

        # a removed spare while enough serve: nothing promoted, never the leaving one
        pool_, driver, units = live_pool(3, spares=1)
        for u in units:
            pool_.assign(u)
        await pool_.fill(["w@0", "w@1"], wanted=1, leaving={"w@2"}, timeout=5)
        await pool_.fill(["w@0"], wanted=1, leaving={"w@1", "w@2"}, timeout=5)
        assert driver.promoted == []  # type: ignore[attr-defined]
        await pool_.stop()

    asyncio.run(scenario())


def test_a_current_awake_spare_serves_one_warm_up_before_it_is_needed_and_only_one() -> None:
    """A real engine's first generation after a start took 32 s on this CPU, and it fell on
    the promotion's canary: the keeper warms a current, awake spare once, off the path."""
    import asyncio

    from structlog.testing import capture_logs

    async def scenario(fail: bool) -> tuple[list[str], bool, list[str]]:
        units = [SimpleNamespace(name=f"w@{i}", pid=None, hold_reason=None,
                                 state=SimpleNamespace(running=True)) for i in range(2)]
        driver = Driver(units)
        warmed: list[str] = []

        async def warm(unit: Any) -> float:
            warmed.append(unit.name)
            if fail:
                from dynamod.rollout.policy import ShardError

                raise ShardError(unit.name, "warm", "HTTP 404: no worker")
            return 12.5

        async def current() -> Any:
            return SimpleNamespace(version=4)

        driver.warm = warm  # type: ignore[attr-defined]
        driver.ledger = lambda: SimpleNamespace(current=current)  # type: ignore[attr-defined]
        driver.note_current = lambda current: None  # type: ignore[attr-defined]
        driver.spec.replay_backoff_initial = 0.01  # type: ignore[attr-defined]
        pool_ = SparePool(driver, 1)  # type: ignore[arg-type]
        assert [pool_.assign(u) for u in units] == [Role.SERVING, Role.SPARE]
        with capture_logs() as logs:
            for _ in range(2):  # two keeper rounds (two pushes): one warm-up when it worked
                pool_._keep_current(units[1])
                slot = pool_.slots["w@1"]
                assert slot.keeper is not None
                await slot.keeper
        await pool_.stop()
        return warmed, pool_.slots["w@1"].warm, [e["event"] for e in logs]

    warmed, warm, events = asyncio.run(scenario(fail=False))
    assert warmed == ["w@1"] and warm and events.count("spares.warmed") == 1, (warmed, events)
    warmed, warm, events = asyncio.run(scenario(fail=True))
    assert warmed == ["w@1", "w@1"] and not warm, "a failed warm-up is tried again next time"
    assert events.count("spares.warm_failed") == 2, events
