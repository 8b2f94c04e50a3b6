"""One trainer rank of bench.publish_nodes, run inside its node's network namespace:

    python -m bench.publish_rank STATE_DIR SHARED RANK WORLD FIRST LAST

For each step FIRST..LAST, `ColocatedSync.update` of the tiny model's tensors scaled by
the step into this node's shards (one rank a node: every shard of its node is its own),
timed. Rank 0 gathers the other ranks' acknowledgements under SHARED (the checkpoint
folder every node reads), publishes, and leaves `published-<step>` there; another rank
waits for that file before its next step, as verl's ranks meet at the next generation.
Prints one JSON list: each step's record (rank 0: the update's own, with the publish's
answer) and its wall seconds; the last also the machine's cores busy % from the second
step on."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench import host

BARRIER_S = 600.0


def published(shared: Path, step: int) -> Path:
    return shared / f"published-{step}"


def wait_published(shared: Path, step: int) -> None:
    deadline = time.monotonic() + BARRIER_S
    while not published(shared, step).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not publish step {step} within {BARRIER_S:g}s")
        time.sleep(0.005)


def main() -> None:
    from safetensors.torch import load_file

    from dynamod.core.paths import cache_dir
    from dynamod.integrations.verl.colocated import ColocatedSync

    state, shared = Path(sys.argv[1]), Path(sys.argv[2])
    rank, world, first, last = (int(a) for a in sys.argv[3:7])
    boot = load_file(str(cache_dir() / "models" / "tiny-cpu" / "model.safetensors"))
    sync = ColocatedSync(state, shared / "checkpoints", state / "weight-ipc", rank=rank,
                         world=world, local_world=1, timeout_s=300)  # fmt: skip
    out: list[dict[str, Any]] = []
    machine = None  # the machine's CPU from the end of the first (warm-up) step on
    try:
        for step in range(first, last + 1):
            if step == first + 1:
                machine, machine_at = host.counters(), time.monotonic()
            scale = 1.0 + step / 100
            started = time.monotonic()
            record = asyncio.run(sync.update(((k, v * scale) for k, v in boot.items()), step))
            wall = time.monotonic() - started
            if rank == 0:
                published(shared, step).touch()
            else:
                wait_published(shared, step)
            out.append({**record, "wall_s": wall})
        if machine is not None:
            busy_s = host.window(machine)["busy_s"]
            wall = time.monotonic() - machine_at
            out[-1]["busy_pct_after_first"] = 100 * busy_s / (wall * (os.cpu_count() or 1))
    finally:
        sync.close()  # the background checkpoint write ends before the process does
    print(json.dumps(out))


if __name__ == "__main__":
    main()
