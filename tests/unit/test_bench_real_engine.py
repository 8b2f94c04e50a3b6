"""bench.real_engine's pure parts: a Cpus_allowed_list read as CPU numbers, so that two
shards sharing a CPU are found whatever the lists' text."""

from __future__ import annotations

from bench.real_engine import cpu_set


def test_a_cpu_list_reads_as_cpu_numbers() -> None:
    assert cpu_set("0-2,5") == {0, 1, 2, 5}
    assert cpu_set("1") == {1}
    # "0-1" and "1" are different text and share CPU 1
    assert cpu_set("0-1") & cpu_set("1") == {1}
    assert not cpu_set("0") & cpu_set("1")
