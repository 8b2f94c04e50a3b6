"""The shape of one unit's row in `status --json`: what the daemon answers, the client
returns, the renderer and the metrics read, and the tests assert on.

The engine fills `EngineUnitStatus`. The extensions each add their own keys through
`Extension.unit_status` (core/extensions.py), declared in `ExtensionUnitStatus`, so one
cannot overwrite another's or the engine's (`state`, `pid`). The rollout layer's keys
are declared here as data shapes only, the wire format being one contract that the
client (which imports core alone) shares; what they mean is written in rollout/.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class DynamoStatus(TypedDict):
    """`dynamo`: a Dynamo worker's registration (rollout/registrations.py)."""

    namespace: str
    system_url: str
    instance_ids: list[int]  # its etcd lease ids; empty once it exited
    routed: bool | None  # the frontend routes to it (None: no frontend view yet)


class PauseClaimStatus(TypedDict):
    """A pause of the shard that a process outside dynamod claimed (rollout/pause_claims.py)."""

    pid: int
    why: str
    for_s: float


class PolicyStatus(TypedDict):
    """`policy`: a rollout shard's policy version (rollout/policy.py)."""

    version: NotRequired[int | None]  # as `policy_version`, once it has one
    current: int | None  # the ledger's version, as last read
    admitted: bool
    digest: str | None
    last_ack_ms: dict[str, float]  # the last update's steps
    last_error: str | None
    routed_version: int | None  # the version a canary through the frontend proved routed
    paused_by: NotRequired[list[PauseClaimStatus]]  # who outside dynamod holds it paused


class SpareStatus(TypedDict):
    """`spare`: a shard's role among the hot spares (rollout/spares.py)."""

    role: str | None  # serving, spare or promoting; None while it is not running
    sleeping: bool
    warm: bool  # its engine has served a generation (dynamod warms an awake spare once)
    promotions: dict[str, int]  # why it was taken into service -> how often
    version: NotRequired[int | None]  # a spare's: the version it holds
    behind: NotRequired[int | None]  # a spare's: versions behind the ledger


class OperatorStop(TypedDict):
    by: str  # who stopped it, in words
    since_s: float


class LimitsStatus(TypedDict):
    """`limits`: a unit's limits, how each is enforced here, OOM kills (core/resources.py)."""

    mechanism: str  # the mechanisms in use, e.g. "cgroup v1" or "cgroup v1 + rlimit"
    limits: dict[str, str]  # limit -> "64M via cgroup v1 memory.limit_in_bytes"
    oom_kills: int  # exits by the kernel's OOM killer over the daemon's run


class EngineUnitStatus(TypedDict):
    name: str
    unit: str
    index: int | None
    state: str
    since_s: float
    pid: int | None
    uptime_s: float | None
    restarts: int
    starts: int
    last_exit: str | None
    detail: str
    log_dropped_bytes: int
    log_drop_reason: str | None
    ports: dict[str, int]
    depends_on: dict[str, str]
    log: str
    explain: str | None  # why a unit that keeps failing fails: its telling log lines
    cause: str | None  # its own cause line (core/causes.py) for its last failed exit, until ready
    command: list[str]
    operator_stop: OperatorStop | None  # held stopped by `dynamod stop` until `start`
    limits: LimitsStatus | None  # set by the unit's `limits` table


class ExtensionUnitStatus(TypedDict, total=False):
    dynamo: DynamoStatus
    policy: PolicyStatus
    # The shard's verified policy version: present once it acknowledged one or exited
    # since (None then); the chaos checkers and verl read its presence as "a shard".
    policy_version: int | None
    spare: SpareStatus


class UnitStatus(EngineUnitStatus, ExtensionUnitStatus):
    """One unit's row in `status --json` (and in last-down.json)."""
