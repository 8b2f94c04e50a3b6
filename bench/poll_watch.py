"""Today's recipe, reduced to its watchdog: start N copies of a command as bare children,
then every INTERVAL seconds check each one (waitpid WNOHANG, as a parent can) and record
when a death is first seen. No restart: the recipe only raises.

    python -m bench.poll_watch --interval 5 --count N --pids FILE --seen FILE --for S -- CMD...

FILE lines are JSON: {"pid": P} once per child; {"pid": P, "t": epoch} per death seen.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--pids", required=True)
    parser.add_argument("--seen", required=True)
    parser.add_argument(
        "--for",
        dest="seconds",
        type=float,
        required=True,
        help="stop after this many seconds (bounded)",
    )
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()
    children = [subprocess.Popen(args.command, stdin=subprocess.DEVNULL) for _ in range(args.count)]
    with open(args.pids, "w") as fh:
        for child in children:
            fh.write(json.dumps({"pid": child.pid}) + "\n")
    watching = {c.pid for c in children}
    deadline = time.monotonic() + args.seconds
    try:
        with open(args.seen, "a", buffering=1) as seen:
            while watching and time.monotonic() < deadline:
                time.sleep(args.interval)
                for pid in sorted(watching):
                    done, _ = os.waitpid(pid, os.WNOHANG)
                    if done:
                        watching.discard(pid)
                        seen.write(json.dumps({"pid": pid, "t": time.time()}) + "\n")
    finally:
        for pid in watching:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
