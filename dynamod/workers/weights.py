"""Policy weights held by a CPU rollout worker: loading a checkpoint and digesting it.

A checkpoint is a directory holding `model.safetensors`. The digest identifies the
tensors, not the file: sha256 over the tensors in sorted-name order, each contributing
its name, dtype, shape and raw little-endian bytes. Re-saving the same tensors (other
metadata, other key order) gives the same digest; changing any value changes it. The
trainer and the policy ledger compute it with `state_dict_digest` to verify a shard.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamod.core.errors import DynamodError

WEIGHTS_FILE = "model.safetensors"


class CheckpointError(DynamodError):
    """A checkpoint could not be loaded; `path` names the file (or directory) at fault."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True)
class WeightSet:
    """One loaded set of policy weights and where it came from."""

    tensors: Mapping[str, Any]
    digest: str
    source: Path

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @property
    def num_bytes(self) -> int:
        return sum(int(t.numel()) * int(t.element_size()) for t in self.tensors.values())


def state_dict_digest(tensors: Mapping[str, Any]) -> str:
    """Hex sha256 of a name -> torch.Tensor mapping (see the module docstring)."""
    import torch

    sha = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        header = f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0"
        header += ",".join(str(d) for d in tensor.shape) + "\0"
        sha.update(header.encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def checkpoint_file(path: Path) -> Path:
    """The safetensors file of a checkpoint given as its directory or the file itself."""
    return path if path.suffix == ".safetensors" else path / WEIGHTS_FILE


def load_checkpoint(path: Path) -> WeightSet:
    """Load every tensor of a checkpoint into CPU memory and digest it.

    Raises CheckpointError naming the file when it is missing, unreadable, not valid
    safetensors, or holds no tensors.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = checkpoint_file(Path(path))
    if not file.parent.is_dir():
        raise CheckpointError(file.parent, "checkpoint directory does not exist")
    if not file.is_file():
        raise CheckpointError(file, "checkpoint file does not exist")
    try:
        tensors = load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(file, f"not a readable safetensors file ({exc})") from exc
    if not tensors:
        raise CheckpointError(file, "checkpoint holds no tensors")
    return WeightSet(tensors=tensors, digest=state_dict_digest(tensors), source=file)
