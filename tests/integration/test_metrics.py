"""Prometheus metrics of a real infra stack, scraped over HTTP and parsed with
prometheus_client's own parser."""

from __future__ import annotations

import os
import signal
import socket
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamod.core.state import UnitState
from tests.conftest import Dynamod, unit_by_name

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> tuple[Samples, dict[str, str]]:
    """(sample name + labels -> value, metric family -> type)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples: Samples = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_metrics_follow_the_stack_through_a_restart(dm: Dynamod) -> None:
    port = free_port()
    dm.run("up", "infra", "--detach", "--metrics-addr", f"127.0.0.1:{port}", check=True)
    samples, types = scrape(port)

    assert types["dynamod_unit_state"] == "gauge"
    assert types["dynamod_unit_restarts"] == "counter"
    assert types["dynamod_probe_duration_seconds"] == "histogram"
    assert value(samples, "dynamod_stack_phase", stack="infra", phase="up") == 1
    assert value(samples, "dynamod_stack_phase", stack="infra", phase="starting") == 0
    for unit in ("etcd", "nats"):
        assert value(samples, "dynamod_unit_state", unit=unit, state="ready") == 1
        states = [v for (n, labels), v in samples.items()
                  if n == "dynamod_unit_state" and ("unit", unit) in labels]
        assert sum(states) == 1 and len(states) == len(UnitState)  # one sample per state
        assert value(samples, "dynamod_unit_restarts_total", unit=unit) == 0
        passed = value(samples, "dynamod_probe_duration_seconds_count",
                       unit=unit, probe="ready", result="ok")
        assert passed == 1
        assert 0 < value(samples, "dynamod_probe_duration_seconds_sum",
                         unit=unit, probe="ready", result="ok") < 2
    assert value(samples, "dynamod_shards_held") == 0
    assert not any(n == "dynamod_unit_last_recovery_seconds" for n, _ in samples)

    nats = unit_by_name(dm.status(), "nats")
    os.kill(nats["pid"], signal.SIGKILL)
    dm.wait_for(lambda s: unit_by_name(s, "nats")["state"] == "ready"
                and unit_by_name(s, "nats")["pid"] != nats["pid"], what="nats back")
    samples, _ = scrape(port)
    assert value(samples, "dynamod_unit_restarts_total", unit="nats") == 1
    assert value(samples, "dynamod_unit_restarts_total", unit="etcd") == 0
    recovery = value(samples, "dynamod_unit_last_recovery_seconds", unit="nats")
    assert 0 < recovery < 10
    assert value(samples, "dynamod_probe_duration_seconds_count",
                 unit="nats", probe="ready", result="ok") == 2

    dm.run("down", check=True)
    with pytest.raises(OSError):
        scrape(port)


def test_bad_or_taken_metrics_address_fails_before_anything_runs(dm: Dynamod) -> None:
    result = dm.run("up", "infra", "--metrics-addr", "localhost")
    assert result.returncode != 0
    assert "--metrics-addr expects HOST:PORT" in result.stderr

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = dm.run("up", "infra", "--metrics-addr", f"127.0.0.1:{port}", timeout=60)
    assert result.returncode != 0
    assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (dm.state_dir / "run.json").exists()  # failed before the daemon started


SLOW_START = """
    [units.slow]
    command = ["{python}", "@PROC@", "serve", "{ports.main}", "--delay", "6"]
    ports = { main = 0 }
    [units.slow.ready]
    kind = "tcp"
    host = "127.0.0.1"
    port = "{ports.main}"
    interval = 0.05
    deadline = 30
"""


def test_a_slow_start_is_probed_less_often_after_its_first_two_seconds(
    dm: Dynamod, stack_file: Any
) -> None:
    """A unit ready after 6 s, probed every 0.05 s: 120 attempts at that pace; with the
    pause growing after 2 s (core/probes.py ready_pause), ~40 in the first 2 s and ~20 in
    the next 4. The daemon's metrics count them."""
    port = free_port()
    dm.run("up", str(stack_file(SLOW_START)), "--detach", "--metrics-addr",
           f"127.0.0.1:{port}", check=True)  # fmt: skip
    samples, _ = scrape(port)
    failed = value(samples, "dynamod_probe_duration_seconds_count",
                   unit="slow", probe="ready", result="fail")  # fmt: skip
    assert value(samples, "dynamod_probe_duration_seconds_count",
                 unit="slow", probe="ready", result="ok") == 1  # fmt: skip
    assert 10 < failed <= 80, failed
    dm.run("down", check=True)
