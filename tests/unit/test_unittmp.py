"""A unit's private temporary directory is emptied at every spawn and removed whole."""

from __future__ import annotations

from pathlib import Path

from dynamod.core import unittmp


def test_each_spawn_gets_an_empty_private_dir_and_teardown_removes_all(tmp_path: Path) -> None:
    env = unittmp.fresh(tmp_path, "worker@0")
    where = Path(env["TMPDIR"])
    assert env == {"TMPDIR": str(where), "TMP": str(where), "TEMP": str(where)}
    assert where == tmp_path / "tmp" / "worker@0" and where.stat().st_mode & 0o777 == 0o700
    (where / "left-by-a-killed-run.json").write_text("{}")
    assert unittmp.fresh(tmp_path, "worker@0") == env
    assert list(where.iterdir()) == []
    (where / "zmq-socket").write_text("")
    unittmp.fresh(tmp_path, "etcd")
    assert unittmp.remove_all(tmp_path) == ["worker@0"]
    assert not (tmp_path / "tmp").exists()
    assert unittmp.remove_all(tmp_path) == []
