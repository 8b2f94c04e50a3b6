"""Benchmark 11 - the colocated path's replay checkpoint: what writing one every step costs
the trainer, written inline beside written in the background.

    python -m bench.verl_checkpoint [--quick] [--json] [--gap S] [--dir DIR]

verl's colocated weight update keeps no file, so dynamod's module writes one per step
(`CheckpointWriter`) for the shards it has to replay. Per model (the tiny CPU model, and a
synthetic state dict of Qwen2.5-0.5B's shapes in bf16, ~0.99 GB), each of `steps`
updates runs as `ColocatedSync` runs it: the tensors go over the real transport
(`ipc.WeightSender`, 512 MB buckets, shared memory) to one receiver process that keeps a
copy and digests what it got, as the CPU worker does, while the trainer takes its host
copy (`HostCopy`); then the step's safetensors checkpoint is written inline (the
trainer waits for it) or submitted to the background writer (the trainer waits only if
the previous step's write is still running). Between updates the trainer "computes" for
`--gap` seconds (a sleep: on a GPU node the trainer's compute is on the GPU, and the
background write competes only for a CPU core and the disk); 3 s, or 0.5 s with --quick,
which writes the tiny model only.

trainer stall = wall time of the update call: send + host copy + (write | submit).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from bench.report import Report, Table, emit, entry, options, ratio, summary

RECEIVER = textwrap.dedent("""
    import logging, sys
    import structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from dynamod.integrations.verl.ipc import WeightReceiver

    class Keep:  # what the CPU worker's host does: a copy of every tensor, then drop it
        def begin(self, step): self.kept = {}
        def load(self, weights): self.kept.update((n, t.clone()) for n, t in weights)
        def finish(self, step, digest): self.kept = {}; return {}
        def abort(self, reason): self.kept = {}

    receiver = WeightReceiver(sys.argv[1], Keep())
    receiver.start()
    print("bound", flush=True)
    sys.stdin.read()
    receiver.close()
""")

# Qwen2.5-0.5B: vocab 151936, hidden 896, intermediate 4864, 24 layers, 2 KV heads of 64,
# tied embeddings (no separate lm_head).
QWEN_05B = {"vocab": 151936, "hidden": 896, "inter": 4864, "layers": 24, "kv": 128}


def synthetic_05b() -> dict[str, Any]:
    import torch

    c = QWEN_05B
    h, i, kv = c["hidden"], c["inter"], c["kv"]

    def t(*shape: int) -> Any:
        return torch.full(shape, 0.01, dtype=torch.bfloat16)

    state = {"model.embed_tokens.weight": t(c["vocab"], h), "model.norm.weight": t(h)}
    for n in range(c["layers"]):
        p = f"model.layers.{n}."
        state |= {
            p + "self_attn.q_proj.weight": t(h, h), p + "self_attn.q_proj.bias": t(h),
            p + "self_attn.k_proj.weight": t(kv, h), p + "self_attn.k_proj.bias": t(kv),
            p + "self_attn.v_proj.weight": t(kv, h), p + "self_attn.v_proj.bias": t(kv),
            p + "self_attn.o_proj.weight": t(h, h),
            p + "mlp.gate_proj.weight": t(i, h), p + "mlp.up_proj.weight": t(i, h),
            p + "mlp.down_proj.weight": t(h, i),
            p + "input_layernorm.weight": t(h), p + "post_attention_layernorm.weight": t(h),
        }
    return state


def tiny() -> dict[str, Any]:
    from safetensors.torch import load_file

    from bench.stack import prebuilt_model

    return dict(load_file(str(prebuilt_model() / "model.safetensors")))


@contextlib.contextmanager
def receiver(address: str) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, address], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, ""):
            if line.strip() == "bound":
                break
        else:
            raise RuntimeError(f"receiver exited {proc.wait()} before binding")
        yield
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=60)


def run_mode(state: dict[str, Any], background: bool, steps: int, gap: float, root: Path,
             address: str) -> dict[str, Any]:
    from dynamod.integrations.verl.checkpoint import CheckpointWriter, HostCopy
    from dynamod.integrations.verl.ipc import WeightSender

    writer = CheckpointWriter(root, keep=2)
    stalls, sends, waits = [], [], []
    try:
        for step in range(1, steps + 1):
            started = time.monotonic()
            copy = HostCopy()
            sender = WeightSender([address], timeout_s=600)
            acks = sender.send(iter(state.items()), step, copy)
            if address not in acks:
                raise RuntimeError(f"step {step} not acknowledged: {sender.errors}")
            sent = time.monotonic()
            if background:
                writer.submit(copy.tensors, step)
            else:
                writer.write(copy.tensors, step)
            done = time.monotonic()
            stalls.append(done - started)
            sends.append(sent - started)
            waits.append(done - sent)
            del copy
            time.sleep(gap)
        writer.wait()
    finally:
        writer.close()
    return {"stall": summary(stalls), "send": summary(sends), "write_wait": summary(waits),
            "write_s": writer.last_write_s}


@entry
def main() -> None:
    parser = options(__doc__.splitlines()[0])
    parser.add_argument("--gap", type=float, default=None,
                        help="seconds of trainer compute between updates (default 3, quick 0.5)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where checkpoints are written (default: a temp dir in /tmp)")
    parser.add_argument("--skip-05b", action="store_true", help="the tiny model only")
    args = parser.parse_args()
    if args.gap is None:
        args.gap = 0.5 if args.quick else 3.0
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    report = Report("verl_checkpoint", "11. Colocated path: the per-step replay checkpoint",
                    args.quick)
    models = [("tiny-cpu (fp32)", tiny, 2 if args.quick else 5)]
    if not (args.skip_05b or args.quick):  # quick: a smoke run, no 1 GB writes
        models.append(("synthetic 0.5B (bf16)", synthetic_05b, 1 if args.quick else 3))
    table = Table("Trainer stall per update, inline write vs background write",
                  ["model", "MB", "steps", "send+copy s", "write s inline",
                   "write s background", "stall inline s", "stall background s",
                   "background / inline"], digits=3)
    with tempfile.TemporaryDirectory(prefix="dmbench-ckpt-", dir=args.dir) as tmp:
        from dynamod.integrations.verl.ipc import socket_address

        address = socket_address(Path(tmp), "bench")
        with receiver(address):
            for label, build, steps in models:
                state = build()
                nbytes = sum(t.numel() * t.element_size() for t in state.values())
                modes = {}
                for background in (False, True):
                    root = Path(tmp) / label.split()[0] / ("bg" if background else "inline")
                    modes[background] = run_mode(state, background, steps, args.gap, root,
                                                 address)
                inline, bg = modes[False], modes[True]
                table.rows.append([
                    label, nbytes / 1e6, steps, inline["send"]["median"],
                    inline["write_wait"]["median"], bg["write_s"], inline["stall"]["median"],
                    bg["stall"]["median"], ratio(bg["stall"]["median"], inline["stall"]["median"]),
                ])
                report.data[label] = {"bytes": nbytes, "inline": inline, "background": bg}
                del state
    report.tables.append(table)
    report.notes += [
        "write s = safetensors write + rename + prune of one step: inline on the trainer's "
        "thread (median), in the background on the writer's thread (the last step's)",
        f"gap between updates: {args.gap:g} s; a background write longer than the gap "
        "makes the next update wait for it (it shows in the stall)",
        "send+copy = the transfer into one receiver process (copy + digest there) with the "
        "trainer's host copy on the way; on a GPU the send is CUDA IPC and the host copy "
        "is a device-to-host copy, neither measured here",
    ]
    emit(report, args.json)


if __name__ == "__main__":
    main()
