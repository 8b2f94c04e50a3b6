"""Policy weights held by a CPU rollout worker: loading a checkpoint and digesting it.

A checkpoint is a directory holding `model.safetensors`. The digest identifies the
tensors, not the file: sha256 over the tensors in sorted-name order, each contributing
its name, dtype, shape and raw little-endian bytes. Re-saving the same tensors (other
metadata, other key order) gives the same digest; changing any value changes it. The
trainer and the policy ledger compute it with `state_dict_digest` over torch tensors, the
worker over numpy arrays (it never imports torch): both give the same bytes to hash, the
dtype spelled as torch and numpy both spell it ("float32"). A checkpoint loads as numpy
arrays (the worker) or torch tensors (the trainer); numpy has no bfloat16, so a checkpoint
holding one is refused by name rather than converted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dynamod.core.errors import DynamodError

WEIGHTS_FILE = "model.safetensors"

Framework = Literal["numpy", "torch"]
# safetensors dtypes numpy can hold (https://huggingface.co/docs/safetensors: header dtypes).
NUMPY_DTYPES = frozenset({"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL"})


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
        return sum(_num_bytes(t) for t in self.tensors.values())


def _num_bytes(tensor: Any) -> int:
    if hasattr(tensor, "element_size"):  # torch
        return int(tensor.numel()) * int(tensor.element_size())
    return int(tensor.nbytes)


def _dtype_and_bytes(tensor: Any) -> tuple[str, bytes]:
    """A torch tensor's or numpy array's dtype name and raw little-endian bytes."""
    if hasattr(tensor, "detach"):  # torch: only imported where the caller already has it
        import torch

        flat = tensor.detach().cpu().contiguous().reshape(-1)
        return str(tensor.dtype).removeprefix("torch."), flat.view(torch.uint8).numpy().tobytes()
    import numpy as np

    array = np.asarray(tensor)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return str(array.dtype), np.ascontiguousarray(array).tobytes()


def state_dict_digest(tensors: Mapping[str, Any]) -> str:
    """Hex sha256 of a name -> tensor mapping, torch tensors or numpy arrays (see the
    module docstring): the same values give the same digest whichever they are."""
    sha = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        dtype, raw = _dtype_and_bytes(tensor)
        header = f"{name}\0{dtype}\0" + ",".join(str(d) for d in tensor.shape) + "\0"
        sha.update(header.encode())
        sha.update(raw)
    return sha.hexdigest()


def checkpoint_file(path: Path) -> Path:
    """The safetensors file of a checkpoint given as its directory or the file itself."""
    return path if path.suffix == ".safetensors" else path / WEIGHTS_FILE


def load_checkpoint(path: Path, framework: Framework = "torch") -> WeightSet:
    """Load every tensor of a checkpoint into CPU memory, as torch tensors or numpy
    arrays, and digest it.

    Raises CheckpointError naming the file when it is missing, unreadable, not valid
    safetensors, holds no tensors, or (numpy) holds a dtype numpy lacks, naming the tensor.
    """
    from safetensors import SafetensorError, safe_open

    file = checkpoint_file(Path(path))
    if not file.parent.is_dir():
        raise CheckpointError(file.parent, "checkpoint directory does not exist")
    if not file.is_file():
        raise CheckpointError(file, "checkpoint file does not exist")
    tensors: dict[str, Any] = {}
    try:
        with safe_open(str(file), "np" if framework == "numpy" else "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if framework == "numpy":
                    dtype = handle.get_slice(name).get_dtype()
                    if dtype not in NUMPY_DTYPES:
                        raise CheckpointError(
                            file,
                            f"tensor {name!r} has dtype {dtype}, which the numpy engine "
                            f"cannot hold (supported: {', '.join(sorted(NUMPY_DTYPES))})",
                        )
                tensors[name] = handle.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
        raise CheckpointError(file, f"not a readable safetensors file ({exc})") from exc
    if not tensors:
        raise CheckpointError(file, "checkpoint holds no tensors")
    return WeightSet(tensors=tensors, digest=state_dict_digest(tensors), source=file)
