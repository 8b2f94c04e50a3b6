"""dynamod.core.cgroups: finding this process's cgroup v2 directory from /proc text, the
containment setting, and how the containment in force is described (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamod.control import render
from dynamod.core import cgroups

HYBRID = """\
22 27 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw
30 22 0:26 / /sys/fs/cgroup rw shared:8 - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw
32 30 0:28 / /sys/fs/cgroup/memory rw shared:10 - cgroup cgroup rw,memory
"""
SYSTEMD = """\
25 1 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""
CONTAINER = """\
400 300 0:30 /kubepods/pod1 /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw
"""


def test_hybrid_host_uses_the_unified_mount() -> None:
    path, why = cgroups.own_cgroup_dir(HYBRID, "4:memory:/x\n0::/\n")
    assert path == Path("/sys/fs/cgroup/unified") and why == ""


def test_systemd_service_finds_its_delegated_subtree() -> None:
    own = "0::/system.slice/dynamod@local.service\n"
    path, _ = cgroups.own_cgroup_dir(SYSTEMD, own)
    assert path == Path("/sys/fs/cgroup/system.slice/dynamod@local.service")


def test_a_mount_of_a_subtree_is_mapped_by_its_root() -> None:
    path, _ = cgroups.own_cgroup_dir(CONTAINER, "0::/kubepods/pod1/app\n")
    assert path == Path("/sys/fs/cgroup/app")


@pytest.mark.parametrize(
    ("mountinfo", "own", "why"),
    [
        (HYBRID, "4:memory:/x\n", "no cgroup v2 entry in /proc/self/cgroup"),
        (HYBRID.replace("cgroup2 cgroup2", "cgroup cgroup"), "0::/\n", "no cgroup2 mount"),
        (CONTAINER, "0::/elsewhere\n", "no cgroup2 mount holds this process's cgroup"),
    ],
)
def test_no_usable_hierarchy_says_why(mountinfo: str, own: str, why: str) -> None:
    path, reason = cgroups.own_cgroup_dir(mountinfo, own)
    assert path is None and reason.startswith(why)


def test_setting_defaults_to_auto_and_refuses_unknown_values() -> None:
    assert cgroups.setting({}) == "auto"
    assert cgroups.setting({cgroups.CONTAINMENT_ENV: " PGroup "}) == "pgroup"
    with pytest.raises(ValueError, match=r"DYNAMOD_CONTAINMENT='jail': expected one of auto"):
        cgroups.setting({cgroups.CONTAINMENT_ENV: "jail"})


def test_forced_fallback_creates_nothing_and_says_why() -> None:
    found = cgroups.detect("r1", {cgroups.CONTAINMENT_ENV: "pgroup"})
    assert found.kind is cgroups.Kind.PGROUP and found.root is None
    assert found.unit("worker@0") is None
    assert found.describe() == "process groups + markers (forced by DYNAMOD_CONTAINMENT=pgroup)"


def test_cgroup_containment_names_its_path_and_each_unit_cgroup() -> None:
    found = cgroups.Containment(cgroups.Kind.CGROUP, Path("/sys/fs/cgroup/unified/dynamod-r1"))
    assert found.describe() == "cgroup v2 at /sys/fs/cgroup/unified/dynamod-r1"
    assert found.unit("worker@0") == Path("/sys/fs/cgroup/unified/dynamod-r1/worker@0")
    assert found.as_dict()["kind"] == "cgroup"


def test_down_report_names_what_it_killed_and_what_survived() -> None:
    clean = {"ok": True, "seconds": 0.2, "killed": {}, "survivors": [], "containment": "x"}
    assert render.down_report(clean)[1:] == [
        "had to kill nothing: every process ended on its stop signal",
        "stack down in 0.20s: nothing left running",
    ]
    bad = {"ok": False, "seconds": 1.5, "killed": {"w@0": [7, 8]}, "survivors": [9]}
    lines = render.down_report(bad)
    assert lines == [
        "had to kill 2 process(es) (SIGKILL / cgroup.kill): w@0: 7 8",
        "COULD NOT KILL 1: [9]",
        "stack down in 1.50s: SURVIVORS [9]",
    ]
