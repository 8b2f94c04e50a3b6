"""dynamod.core.shmleft on a made-up /proc and /dev/shm: which files processes hold (open or
mapped; an unlinked one does not count), and which of a unit's are removed (those nobody
holds, in /dev/shm itself, regular files of dynamod's own user)."""

from __future__ import annotations

import os
from pathlib import Path

from dynamod.core import shmleft


def _process(proc: Path, pid: int, fds: dict[str, str], maps: list[str]) -> None:
    root = proc / str(pid)
    (root / "fd").mkdir(parents=True)
    for fd, target in fds.items():
        os.symlink(target, root / "fd" / fd)
    (root / "maps").write_text("".join(f"{line}\n" for line in maps))


def _maps_line(path: str) -> str:
    return f"7f0000000000-7f0000010000 rw-s 00000000 00:1a 12345                      {path}"


def test_a_process_holds_what_it_has_open_or_mapped_in_shm_only(tmp_path: Path) -> None:
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    shm.mkdir()
    _process(proc, 10, {"3": f"{shm}/open", "4": "/etc/hosts", "5": "socket:[77]",
                        "6": f"{shm}/gone (deleted)"},
             [_maps_line(f"{shm}/mapped"), _maps_line("/usr/lib/libc.so.6"),
              _maps_line(f"{shm}/unlinked (deleted)"), "7f00-7f01 r--p 00000000 00:00 0"])
    _process(proc, 11, {"3": f"{shm}/other"}, [])
    assert shmleft.held([10], shm=shm, proc=proc) == {shm / "open", shm / "mapped"}
    assert shmleft.held([10, 11, 99], shm=shm, proc=proc) == {
        shm / "open", shm / "mapped", shm / "other"}  # 99: gone, holds nothing
    assert shmleft.held([], shm=shm, proc=proc) == set()


def test_only_what_no_live_process_holds_is_removed(tmp_path: Path) -> None:
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    shm.mkdir()
    for name in ("left", "still-held", "mapped-elsewhere"):
        (shm / name).write_bytes(b"x")
    (shm / "a-dir").mkdir()
    outside = tmp_path / "not-shm"
    outside.write_bytes(b"x")
    _process(proc, 20, {"7": f"{shm}/still-held"}, [_maps_line(f"{shm}/mapped-elsewhere")])
    asked = [shm / n for n in ("left", "still-held", "mapped-elsewhere", "a-dir", "missing")]
    removed = shmleft.remove_unheld([*asked, outside], shm=shm, proc=proc)
    assert removed == [shm / "left"]
    assert sorted(p.name for p in shm.iterdir()) == ["a-dir", "mapped-elsewhere", "still-held"]
    assert outside.exists()  # not in /dev/shm itself: never touched


def test_another_users_file_is_left(tmp_path: Path) -> None:
    """Its holders may be processes whose /proc cannot be read: it is not judged."""
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    shm.mkdir()
    proc.mkdir()
    (shm / "theirs").write_bytes(b"x")
    assert shmleft.remove_unheld([shm / "theirs"], shm=shm, proc=proc,
                                 owner=os.geteuid() + 1) == []  # fmt: skip
    assert (shm / "theirs").exists()
    assert shmleft.remove_unheld([shm / "theirs"], shm=shm, proc=proc) == [shm / "theirs"]


def test_a_noted_file_counts_only_while_it_is_the_same_file(tmp_path: Path) -> None:
    """What a unit held at its readiness is removed at its stop only if it is still that
    file: one removed and made again since (by anyone) has another inode and is kept."""
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("kept", "remade"):
        (shm / name).write_bytes(b"x")
    noted = shmleft.identities([shm / "kept", shm / "remade", shm / "never"])
    assert set(noted) == {shm / "kept", shm / "remade"}  # one that does not exist: none
    (shm / "remade").rename(shm / "old")  # still there: the new file cannot take its inode
    (shm / "remade").write_bytes(b"y")
    assert shmleft.same(noted) == {shm / "kept"}
    (shm / "kept").unlink()
    assert shmleft.same(noted) == set()
