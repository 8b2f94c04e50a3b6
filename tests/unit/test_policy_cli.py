"""`dynamod policy publish --ack/--acks`: acknowledgements from the command line, and bad
ones refused with one line and status 2 before anything reaches a daemon."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dynamod.control.cli import main
from dynamod.control.commands.policy import _acks


def test_no_ack_given_means_none_so_the_daemon_checks_no_acknowledgement() -> None:
    assert _acks((), None) is None


def test_pairs_and_file_merge_and_a_pair_wins_over_the_file(tmp_path: Path) -> None:
    file = tmp_path / "acks.json"
    file.write_text(json.dumps({"worker@0": "aa", "worker@1": None}))
    assert _acks(("worker@1=bb", "worker@2=c=d"), file) == {
        "worker@0": "aa",
        "worker@1": "bb",
        "worker@2": "c=d",
    }


@pytest.mark.parametrize("pair", ["worker@0", "=abc", "worker@0="])
def test_a_malformed_pair_is_refused(pair: str) -> None:
    with pytest.raises(click.UsageError, match="expected SHARD=DIGEST"):
        _acks((pair,), None)


@pytest.mark.parametrize(
    ("text", "says"),
    [("{", "not JSON"), ('["worker@0"]', "JSON object"), ('{"worker@0": 3}', "JSON object")],
)
def test_a_bad_acks_file_is_refused_naming_it(tmp_path: Path, text: str, says: str) -> None:
    file = tmp_path / "acks.json"
    file.write_text(text)
    with pytest.raises(click.UsageError, match=says):
        _acks((), file)


def test_cli_refuses_a_bad_ack_with_one_line_and_status_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main,
        ["--state-dir", str(tmp_path), "policy", "publish", "--step", "1",
         "--path", str(tmp_path), "--ack", "worker@0"],
    )
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("dynamod policy publish: --ack 'worker@0': expected SHARD=DIGEST")
    assert not (tmp_path / "dynamod.sock").exists()


def test_cli_with_good_acks_gets_as_far_as_the_daemon(tmp_path: Path) -> None:
    """No daemon runs here: a well-formed publish fails on that (status 1), not on parsing."""
    result = CliRunner().invoke(
        main,
        ["--state-dir", str(tmp_path), "policy", "publish", "--step", "1",
         "--path", str(tmp_path), "--ack", "worker@0=ab12"],
    )
    assert result.exit_code == 1, result.output
    assert "dynamod: policy publish failed:" in result.output
