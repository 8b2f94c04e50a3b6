"""The colocated weight transport: tensors as IPC handles over ZMQ, in bounded buckets.

The trainer (`WeightSender`) copies its tensors into one bucket buffer of `bucket_bytes`
and sends, per bucket, where each tensor lies in it; every target shard's receiver
(`WeightReceiver`, a sidecar thread inside the shard's worker process) maps the same
buffer and hands the bucket's tensors to its `UpdateLoader`. The buffer's handle travels
once per update: for a CUDA buffer, torch.multiprocessing's CUDA IPC reduction
(`reduce_tensor`, rebuilt on the receiver's device as verl's `rebuild_ipc` does); for a
CPU buffer, a file in /dev/shm that both sides map with `torch.from_file(shared=True)`.
(torch's own CPU reduction, the `file_system` strategy, starts a torch_shm_manager that
the shards keep alive: a process of the trainer's that outlives it. The default
`file_descriptor` strategy cannot pass a descriptor between unrelated processes.) The
sender unlinks the file when the update ends. A tensor larger than a bucket goes alone
in a buffer of its own. The shapes follow verl 0.9.1's `BucketedWeightSender` /
`BucketedWeightReceiver`, with three differences: the receiver binds (it outlives any
one update, as the recipe's sidecar does), one buffer can feed several shards, and
every reply says ok or why not; the last one is the shard's acknowledgement (its step,
what it loaded, its digest).

Messages (pickled), each answered before the next is sent:
  {"op": "begin", "step": N, "buffer": handle}       -> {"ok": true}
  {"op": "bucket", "tensors": [meta...], "buffer": handle | None}  -> {"ok": true}
  {"op": "end"}                                       -> {"ok": true, "step": N, ...ack}
A receiver that sees `begin` mid-update drops the unfinished one (`loader.abort`).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch
import zmq

from dynamod.integrations.verl.errors import VerlIntegrationError

log = structlog.get_logger("dynamod.integrations.verl.ipc")

IPC_DIR_ENV = "DYNAMOD_WEIGHT_IPC_DIR"
UNIT_ENV = "DYNAMOD_UNIT"
DEFAULT_BUCKET_BYTES = 512 << 20  # verl's update_weights_bucket_megabytes default
_MAX_SOCKET_PATH = 107  # sun_path, less its terminating NUL


class WeightTransferError(VerlIntegrationError, RuntimeError):
    """A weight update did not reach a shard; names the shard's socket and the step."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


class UpdateLoader(Protocol):
    """What a receiver drives: one call per update phase, on the receiver's thread."""

    def begin(self, step: int) -> None: ...

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """The bucket's tensors are views of the shared buffer: copy what is kept."""

    def finish(self, step: int, digest: str) -> dict[str, Any]: ...

    def abort(self, reason: str) -> None: ...


def socket_address(ipc_dir: Path, unit: str, rank: int = 0) -> str:
    """The ZMQ address of shard `unit`'s receiver for vLLM worker `rank` (TP rank)."""
    path = Path(ipc_dir).absolute() / f"{unit}.rank{rank}.sock"
    if len(str(path).encode()) > _MAX_SOCKET_PATH:
        raise WeightTransferError(
            f"weight socket path {path} is {len(str(path).encode())} bytes, over the "
            f"{_MAX_SOCKET_PATH}-byte limit of a Unix socket: set {IPC_DIR_ENV} (the stack's "
            "var weight_ipc_dir) to a shorter directory"
        )
    return f"ipc://{path}"


def address_from_env(rank: int = 0) -> str | None:
    """This shard's receiver address, when its unit enables the transport (else None)."""
    ipc_dir, unit = os.environ.get(IPC_DIR_ENV), os.environ.get(UNIT_ENV)
    if not ipc_dir or not unit:
        return None
    return socket_address(Path(ipc_dir), unit, rank)


class TransferDigest:
    """sha256 over the tensors received, independent of the order they came in: each
    tensor's name, dtype, shape and bytes hash to one line; the lines are hashed sorted."""

    def __init__(self) -> None:
        self._lines: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        sha = hashlib.sha256(data.numpy().tobytes())
        shape = ",".join(str(d) for d in tensor.shape)
        dtype = str(tensor.dtype).removeprefix("torch.")
        self._lines[name] = f"{name}\0{dtype}\0{shape}\0{sha.hexdigest()}"

    def hexdigest(self) -> str:
        return hashlib.sha256("\n".join(self._lines[k] for k in sorted(self._lines)).encode()
                              ).hexdigest()

    def __len__(self) -> int:
        return len(self._lines)


def transfer_digest(weights: Iterable[tuple[str, torch.Tensor]]) -> str:
    digest = TransferDigest()
    for name, tensor in weights:
        digest.add(name, tensor)
    return digest.hexdigest()


SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class HostBuffer:
    """A CPU bucket buffer's handle: a file both processes map."""

    path: str
    size: int


@dataclass
class _Buffer:
    tensor: torch.Tensor
    handle: Any
    file: Path | None = None

    def release(self) -> None:
        if self.file is not None:
            self.file.unlink(missing_ok=True)
        elif self.tensor.is_cuda:
            # The receivers' handles are closed (each replied to the last message): let
            # CUDA free the blocks it kept for them, as verl's sender does.
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


def _allocate(nbytes: int, device: torch.device) -> _Buffer:
    if device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return _Buffer(tensor, reduce_tensor(tensor))  # type: ignore[no-untyped-call]
    folder = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
    file = folder / f"dynamod-weights-{os.getpid()}-{uuid.uuid4().hex}"
    with file.open("wb") as fh:
        fh.truncate(nbytes)
    tensor = torch.from_file(str(file), shared=True, size=nbytes, dtype=torch.uint8)
    return _Buffer(tensor, HostBuffer(str(file), nbytes), file)


def _rebuild(handle: Any, device: torch.device | None) -> torch.Tensor:
    if isinstance(handle, HostBuffer):
        return torch.from_file(handle.path, shared=True, size=handle.size, dtype=torch.uint8)
    func, args = handle
    args = list(args)
    # CUDA IPC: the tensor's device index as the receiver numbers it (its own
    # CUDA_VISIBLE_DEVICES may differ from the trainer's), as verl's rebuild_ipc does.
    if device is not None:
        args[6] = device.index if device.index is not None else 0
    tensor: torch.Tensor = func(*args)
    return tensor


def _aligned(offset: int, alignment: int) -> int:
    """The receiver views the buffer with each tensor's dtype: align to its item size."""
    return (offset + alignment - 1) // alignment * alignment


class WeightSender:
    """One update to one or more shards (each a receiver address); blocking, so run it
    in a thread from async code. `timeout_s` bounds every reply: a dead or wedged shard
    fails with WeightTransferError naming it, and the other targets carry on."""

    def __init__(self, addresses: Sequence[str], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float = 120.0) -> None:
        if bucket_bytes < 1:
            raise WeightTransferError(f"bucket size must be positive, got {bucket_bytes}")
        self.addresses = list(addresses)
        self.bucket_bytes = bucket_bytes
        self.timeout_ms = int(timeout_s * 1000)
        self.errors: dict[str, str] = {}
        self.buckets = 0
        self.bytes_sent = 0

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], step: int,
             tap: Any = None) -> dict[str, dict[str, Any]]:
        """Send every tensor; `tap(name, tensor)` sees each on the way (the checkpoint's
        copy), even after every target failed. Returns each address's acknowledgement;
        the failed ones are in `errors`."""
        context: zmq.Context[Any] = zmq.Context.instance()
        sockets = {a: self._connect(context, a) for a in self.addresses}
        bucket: _Buffer | None = None
        pending: list[TensorMeta] = []
        offset = 0
        acks: dict[str, dict[str, Any]] = {}
        try:
            for name, tensor in weights:
                tensor = tensor.detach()
                if tap is not None:
                    tap(name, tensor)
                if not sockets:  # every target failed: the tap still sees every tensor
                    continue
                if bucket is None:
                    bucket = _allocate(self.bucket_bytes, tensor.device)
                    self._all(sockets, {"op": "begin", "step": step, "buffer": bucket.handle})
                if tensor.nbytes > self.bucket_bytes:  # in order: what is pending goes first
                    self._flush(sockets, pending, bucket.tensor)
                    pending, offset = [], 0
                    self._send_alone(sockets, name, tensor)
                    continue
                offset = _aligned(offset, tensor.element_size())
                if offset + tensor.nbytes > self.bucket_bytes:
                    self._flush(sockets, pending, bucket.tensor)
                    pending, offset = [], 0
                view = bucket.tensor[offset:offset + tensor.nbytes].view(tensor.dtype)
                view.view(tensor.shape).copy_(tensor, non_blocking=True)
                pending.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset))
                offset += tensor.nbytes
            if bucket is None:
                if sockets:
                    raise WeightTransferError(f"step {step}: the trainer sent no tensors")
                return acks
            self._flush(sockets, pending, bucket.tensor)
            for address, reply in self._all(sockets, {"op": "end"}).items():
                acks[address] = reply
        finally:
            for sock in sockets.values():
                sock.close(linger=0)
            if bucket is not None:
                bucket.release()
        return acks

    def _connect(self, context: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = context.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def _flush(self, sockets: dict[str, zmq.Socket[Any]], metas: list[TensorMeta],
               buffer: torch.Tensor) -> None:
        if not metas:
            return
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        self._all(sockets, {"op": "bucket", "tensors": metas, "buffer": None})
        self.buckets += 1
        self.bytes_sent += sum(m.nbytes for m in metas)

    def _send_alone(self, sockets: dict[str, zmq.Socket[Any]], name: str,
                    tensor: torch.Tensor) -> None:
        meta = TensorMeta(name, tensor.dtype, tuple(tensor.shape), 0)
        if tensor.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            own = tensor.contiguous()
            torch.cuda.synchronize(own.device)
            alone = _Buffer(own, reduce_tensor(own))  # type: ignore[no-untyped-call]
        else:
            alone = _allocate(tensor.nbytes, tensor.device)
            alone.tensor.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        try:
            self._all(sockets, {"op": "bucket", "tensors": [meta], "buffer": alone.handle})
        finally:
            alone.release()
        self.buckets += 1
        self.bytes_sent += meta.nbytes

    def _all(self, sockets: dict[str, zmq.Socket[Any]], message: dict[str, Any]
             ) -> dict[str, dict[str, Any]]:
        """Send to every live target, then wait for each reply; a target that fails is
        dropped (its error kept) and the update goes on to the others."""
        if not sockets:
            return {}
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        sent = []
        for address, sock in list(sockets.items()):
            try:
                sock.send(data)
                sent.append(address)
            except zmq.ZMQError as exc:
                self._drop(sockets, address, f"{message['op']}: send failed ({exc})")
        replies: dict[str, dict[str, Any]] = {}
        for address in sent:
            try:
                reply = pickle.loads(sockets[address].recv())
            except zmq.Again:
                self._drop(sockets, address, f"{message['op']}: no reply within "
                                             f"{self.timeout_ms / 1000:g}s")
                continue
            if not isinstance(reply, dict) or not reply.get("ok"):
                error = reply.get("error") if isinstance(reply, dict) else repr(reply)
                self._drop(sockets, address, f"{message['op']}: {error}")
                continue
            replies[address] = reply
        return replies

    def _drop(self, sockets: dict[str, zmq.Socket[Any]], address: str, error: str) -> None:
        sockets.pop(address).close(linger=0)
        self.errors[address] = error
        log.warning("verl.ipc_target_failed", address=address, error=error)


class WeightReceiver:
    """A shard's sidecar: binds `address`, answers one message at a time on its thread.

    With `digest` on (the default) every received tensor is hashed (`TransferDigest`),
    which copies it to host memory; off, the acknowledgement carries no digest.
    """

    def __init__(self, address: str, loader: UpdateLoader, device: torch.device | None = None,
                 digest: bool = True) -> None:
        self.address = address
        self.loader = loader
        self.device = device
        self.digest_enabled = digest
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        # Per update:
        self._step: int | None = None
        self._buffer: torch.Tensor | None = None
        self._digest = TransferDigest()
        self._tensors = 0
        self._bytes = 0
        self._started = 0.0

    def start(self, timeout: float = 10.0) -> None:
        if self.address.startswith("ipc://"):
            path = Path(self.address.removeprefix("ipc://"))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # a socket file left by a killed predecessor
        self._thread = threading.Thread(target=self._run, name="dynamod-weight-receiver",
                                        daemon=True)
        self._thread.start()
        if not self._bound.wait(timeout):
            raise WeightTransferError(f"{self.address}: receiver did not bind in {timeout}s")
        if self._bind_error is not None:
            raise WeightTransferError(
                f"{self.address}: cannot bind the weight receiver: {self._bind_error}"
            ) from self._bind_error

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        context: zmq.Context[Any] = zmq.Context.instance()
        sock: zmq.Socket[Any] = context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as exc:
            self._bind_error = exc
            self._bound.set()
            sock.close()
            return
        self._bound.set()
        log.info("verl.ipc_receiver_bound", address=self.address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                raw = sock.recv()
                try:
                    reply = self._handle(pickle.loads(raw))
                except Exception as exc:  # answered, never fatal to the shard
                    log.exception("verl.ipc_update_failed", step=self._step)
                    self._reset(f"{type(exc).__name__}: {exc}")
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                sock.send(pickle.dumps(reply))
        finally:
            sock.close()
            if self.address.startswith("ipc://"):
                Path(self.address.removeprefix("ipc://")).unlink(missing_ok=True)

    def _handle(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        if op == "begin":
            if self._step is not None:
                self._reset(f"step {message.get('step')} began before step {self._step} ended")
            self._step = int(message["step"])
            self._buffer = _rebuild(message["buffer"], self.device)
            self._digest = TransferDigest()
            self._tensors = self._bytes = 0
            self._started = time.monotonic()
            self.loader.begin(self._step)
            return {"ok": True}
        if self._step is None or self._buffer is None:
            return {"ok": False, "error": f"{op!r} outside an update (no 'begin' seen)"}
        if op == "bucket":
            buffer = self._buffer if message["buffer"] is None else _rebuild(
                message["buffer"], self.device)
            weights = []
            for meta in message["tensors"]:
                raw = buffer[meta.offset:meta.offset + meta.nbytes]
                tensor = raw.view(meta.dtype).view(meta.shape)
                weights.append((meta.name, tensor))
                if self.digest_enabled:
                    self._digest.add(meta.name, tensor)
                self._tensors += 1
                self._bytes += meta.nbytes
            self.loader.load(weights)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)
            return {"ok": True}
        if op == "end":
            step, digest = self._step, self._digest.hexdigest() if self.digest_enabled else ""
            # The loader may name the digest of the weights as the shard now holds them
            # (the CPU worker's, the one it reports on get_weight_version).
            ack = {"ok": True, "step": step, "tensors": self._tensors, "bytes": self._bytes,
                   "transfer_digest": digest or None, "digest": digest or None,
                   **self.loader.finish(step, digest),
                   "seconds": round(time.monotonic() - self._started, 3)}
            self._step, self._buffer = None, None
            log.info("verl.ipc_update_received", **{k: v for k, v in ack.items() if k != "ok"})
            return ack
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _reset(self, reason: str) -> None:
        if self._step is not None:
            self.loader.abort(reason)
        self._step, self._buffer = None, None
