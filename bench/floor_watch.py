"""The floor of exit detection on this machine: no supervisor, only a process blocked in
`select` on the pidfd of its one child (`sleep infinity`), which notes time.time() when it
wakes. Children one at a time: it prints a child's pid, and once woken by its death the
wake time, then starts the next.

    python -m bench.floor_watch --count N

stdout lines: "pid P", then "woke T" (epoch seconds) after P dies.
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, required=True)
    args = parser.parse_args()
    for _ in range(args.count):
        child = subprocess.Popen(["sleep", "infinity"], stdin=subprocess.DEVNULL)
        fd = os.pidfd_open(child.pid)
        print(f"pid {child.pid}", flush=True)
        select.select([fd], [], [])
        woke = time.time()
        child.wait()
        os.close(fd)
        print(f"woke {woke!r}", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
