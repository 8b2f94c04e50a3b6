"""A push answered early (`serving = K`) makes the trainer wait on K shards' updates. A
shard unit with a `nice` of its own (`[units.worker.limits] nice`: the daemon and the
stack's other units go first on a busy node) would wait its turn behind them on the
node's cores for that update too. With `[policy] lift_answering` (on by default), each
of those K updates runs at the daemon's own priority: the shard's weight (its session's
autogroup, its v2 cgroup's cpu.weight, its threads' nice: whichever its `nice` was
enforced with) is lifted for the update and set back after it, answered or failed.

At 8 nodes x 32 shards on two cores, the answer's shard at nice 10 waited 34-179 ms for
a core in updates of 69-133 ms, against 22-37 ms on one (docs/benchmarks.md 16).

Lowering a nice takes CAP_SYS_NICE (a root daemon has it); where the daemon may not, the
update runs as it is and the daemon logs why (`policy.shard_not_lifted`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import structlog

from dynamod.core.engine import Engine
from dynamod.core.errors import DynamodError

log = structlog.get_logger("dynamod.policy")


@contextlib.asynccontextmanager
async def ahead(engine: Engine, shard: str) -> AsyncIterator[bool]:
    """The shard's update inside: its unit weighed as at the daemon's own nice, then as
    its own `nice` again. It holds whether the shard was lifted."""
    unit = engine.units.get(shard)
    pid = unit.pid if unit is not None else None
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    lifted = pid is not None and reweigh(engine, shard, pid, nice)
    try:
        yield lifted
    finally:
        if lifted and pid is not None:
            reweigh(engine, shard, pid, None)


def reweigh(engine: Engine, shard: str, pid: int, nice: int | None) -> bool:
    """`engine.host.reweigh`, logged; False where it did nothing or could not."""
    try:
        done = engine.host.reweigh(shard, pid, nice)
    except (ProcessLookupError, FileNotFoundError):  # the shard is gone: its update fails
        return False
    except (OSError, DynamodError) as exc:
        log.warning("policy.shard_not_lifted", unit=shard, pid=pid, nice=nice,
                    error=f"{exc.__class__.__name__}: {exc}")  # fmt: skip
        return False
    if done:
        log.info("policy.shard_lifted" if nice is not None else "policy.shard_lowered",
                 unit=shard, pid=pid, nice=nice)  # fmt: skip
    return done
