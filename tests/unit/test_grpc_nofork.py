"""The daemon's gRPC (the etcd client) runs no fork handlers when dynamod forks a unit: the
handlers are gRPC's default in grpcio 1.85 and log "skipping fork() handlers" whenever a
fork meets gRPC threads at work. The control, importing grpc directly, must show them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import asyncio, subprocess, sys
    if sys.argv[1] == "dynamod":
        import dynamod.rollout.etcd  # what the daemon imports
    from grpc import aio

    async def main():
        channel = aio.insecure_channel("127.0.0.1:1")
        busy = True

        async def spin():  # gRPC at work on the loop while another thread forks
            while busy:
                try:
                    await asyncio.wait_for(channel.channel_ready(), 0.005)
                except Exception:
                    pass

        task = asyncio.create_task(spin())
        for _ in range(60):  # preexec_fn: a real fork(), as dynamod's spawner does
            proc = await asyncio.to_thread(
                lambda: subprocess.Popen(["true"], preexec_fn=lambda: None))
            proc.wait()
        busy = False
        await task

    asyncio.run(main())
    import os
    print("inherited:", os.environ.get("GRPC_ENABLE_FORK_SUPPORT"))
""")


def forks(importing: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", SCRIPT, importing], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def test_dynamods_etcd_client_leaves_them_off_and_the_environment_as_it_was() -> None:
    # The control first: plain grpc, forking the same way, must show the handlers, or the
    # check below could not fail (with a grpcio that has them off by default, drop this test).
    control = forks("grpc")
    assert "fork() handlers" in control.stderr, (
        "plain grpc logged no fork handlers, so the absence below would prove nothing:\n"
        + control.stderr[-2000:]
    )
    done = forks("dynamod")
    assert "fork() handlers" not in done.stderr
    assert done.stdout.strip() == "inherited: None"  # the units' environment is untouched
