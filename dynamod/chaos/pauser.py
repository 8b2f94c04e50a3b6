"""A pause made outside dynamod, as verl's trainer makes one: claim a shard's pause on its
node's control socket (`Client.policy_pause`), then pause it at its system port
(`pause_generation`, mode keep), and stay until killed (or, `--release`, release the
claim and exit). The chaos step `orphan_pause` kills it -9 with its claim open.

  python -m dynamod.chaos.pauser STATE_DIR UNIT SYSTEM_URL [--release]

Prints one JSON line for the claim's answer and one for the pause's; exit 2 with one line
when either is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dynamod.chaos.stack import engine_call
from dynamod.client import Client
from dynamod.core.errors import DaemonError

WHY = "chaos: a pauser killed with its claim open"


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4) or (len(argv) == 4 and argv[3] != "--release"):
        print("usage: python -m dynamod.chaos.pauser STATE_DIR UNIT SYSTEM_URL [--release]",
              file=sys.stderr)  # fmt: skip
        return 2
    state_dir, unit, url = Path(argv[0]), argv[1], argv[2]
    client = Client(state_dir)
    try:
        print(json.dumps(client.policy_pause([unit], WHY)), flush=True)
        print(json.dumps(engine_call(url, "pause_generation", {"mode": "keep"})), flush=True)
        if len(argv) == 4:
            print(json.dumps(client.policy_release([unit])), flush=True)
            return 0
    except (DaemonError, OSError, ValueError) as exc:
        print(f"pauser: {unit}: {exc}", file=sys.stderr)
        return 2
    while True:
        time.sleep(3600)


def start(state_dir: Path, unit: str, url: str, *, release: bool = False,
          wrap: Sequence[str] = ()) -> tuple[subprocess.Popen[str], list[str]]:  # fmt: skip
    """The pauser, started and past its pause, with the lines it printed; RuntimeError
    with its output if it failed first (its own calls are bounded: 30 s, 5 s). `wrap`:
    a command it runs under (`unshare --pid --fork --kill-child`: a container's pid
    namespace)."""
    proc = subprocess.Popen(
        [*wrap, sys.executable, "-m", "dynamod.chaos.pauser", str(state_dir), unit, url,
         *(["--release"] if release else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    while len(lines) < (3 if release else 2) and (line := proc.stdout.readline()):
        lines.append(line)
    if len(lines) < (3 if release else 2):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise RuntimeError(f"the pauser of {unit} failed: {''.join(lines)}{err.strip()}")
    return proc, lines


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
