"""Pause claims (rollout/pause_claims.py): the body a claim or release takes, and the watch
on real claimer processes (a child `sleep`), killed, released or ended by dynamod."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamod.core.errors import DynamodError
from dynamod.rollout.pause_claims import Claim, ClaimError, PauseClaims, parse_body

SHARDS = ["worker@0", "worker@1"]


def test_the_body_names_this_node_s_shards_and_why() -> None:
    assert parse_body({"shards": ["worker@1"], "why": "rank 0"}, SHARDS, claiming=True) == (
        ["worker@1"], "rank 0")
    assert parse_body({}, SHARDS, claiming=False) == (None, "")  # a release of all of them
    assert parse_body({"shards": [], "why": "x" * 500}, SHARDS, claiming=True)[1] == "x" * 200
    for bad in (None, [], {"why": "no shards"}, {"shards": "worker@0"}, {"shards": [1]},
                {"shards": SHARDS, "why": 3}):  # fmt: skip
        with pytest.raises(DynamodError, match="expected a JSON body"):
            parse_body(bad, SHARDS, claiming=True)
    with pytest.raises(DynamodError, match="not a rollout shard of this node: etcd, n1/worker@0"):
        parse_body({"shards": ["worker@0", "n1/worker@0", "etcd"]}, SHARDS, claiming=True)


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


async def _until(condition: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_claimer_that_exits_with_claims_open_orphans_exactly_those() -> None:
    orphans: list[tuple[str, Claim]] = []

    async def main() -> None:
        claims = PauseClaims(lambda shard, claim: orphans.append((shard, claim)))
        dies, lives = _sleeper(), _sleeper()
        try:
            assert claims.claim(dies.pid, ["worker@1", "worker@0"], "rank 0") == SHARDS
            claims.claim(lives.pid, ["worker@0"], "replica 0")
            assert [c["pid"] for c in claims.of("worker@0")] == [dies.pid, lives.pid]
            assert claims.release(dies.pid, ["worker@0"]) == ["worker@0"]
            dies.kill()
            await _until(lambda: orphans)
            # only its claim still open; worker@0's other claimer lives on
            assert [(s, c.pid, c.why) for s, c in orphans] == [("worker@1", dies.pid, "rank 0")]
            assert claims.claimed() == ["worker@0"]
            claims.ended("worker@0")  # dynamod resumed it
            assert claims.claimed() == [] and claims._watched == {}
            lives.kill()
            await asyncio.sleep(0.2)
            assert len(orphans) == 1
        finally:
            for proc in (dies, lives):
                proc.kill()
                proc.wait()
            claims.close()

    asyncio.run(main())


def test_a_released_claimer_is_no_longer_watched_and_a_gone_one_cannot_claim() -> None:
    orphans: list[tuple[str, Claim]] = []

    async def main() -> None:
        claims = PauseClaims(lambda shard, claim: orphans.append((shard, claim)))
        proc = _sleeper()
        try:
            claims.claim(proc.pid, SHARDS, "replica 1")
            assert claims.release(proc.pid) == SHARDS  # all of its claims
            assert claims._watched == {}
            assert claims.claim(proc.pid, [], "nothing") == [] and claims._watched == {}
            proc.kill()
            proc.wait()
            await asyncio.sleep(0.2)
            assert orphans == []
            with pytest.raises(ClaimError, match=f"process {proc.pid} is gone"):
                claims.claim(proc.pid, SHARDS, "too late")
        finally:
            proc.kill()
            proc.wait()
            claims.close()

    asyncio.run(main())


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@given(body=st.one_of(JSON, st.fixed_dictionaries(
    {"shards": st.lists(st.sampled_from([*SHARDS, "etcd", "n1/worker@0"]), max_size=3)},
    optional={"why": st.text(max_size=300) | JSON})))  # fmt: skip
def test_any_body_is_taken_or_refused_in_words(body: object) -> None:
    """Whatever a caller sends, the answer is a claim's shards and reason, or one
    DynamodError (a 400 with its line), never another exception."""
    try:
        shards, why = parse_body(body, SHARDS, claiming=True)
    except DynamodError as exc:
        assert str(exc)
        return
    assert shards is not None and set(shards) <= set(SHARDS) and len(why) <= 200
