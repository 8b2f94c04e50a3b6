"""scripts/validate-gpu.sh on a machine it cannot validate (this one: no GPU, no vLLM): it
refuses with one line on stderr and exit status 2, and runs and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "validate-gpu.sh"


def fake_nvidia_smi(folder: Path, gpus: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(gpus))
    tool.write_text("#!/bin/sh\n" + lines)
    tool.chmod(0o755)
    return folder


def run(tmp_path: Path, path_dirs: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"VLLM_PYTHON", "MODEL_PATH"}}
    env["PATH"] = ":".join([*map(str, path_dirs), "/usr/bin", "/bin"])
    env["PYTHON"] = sys.executable  # has dynamod, not vLLM
    env["STATE_DIR"] = str(tmp_path / "state")
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "report.txt")], env=env,
                          capture_output=True, text=True, timeout=60)


def assert_refused(result: subprocess.CompletedProcess[str], tmp_path: Path, why: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("validate-gpu.sh: refused, nothing run: ")
    assert why in lines[0]
    assert not (tmp_path / "report.txt").exists() and not (tmp_path / "state").exists()


def test_refuses_without_gpus(tmp_path: Path) -> None:
    assert_refused(run(tmp_path, []), tmp_path, "needs 2 NVIDIA GPUs; nvidia-smi lists 0")


def test_refuses_with_one_gpu(tmp_path: Path) -> None:
    bin_dir = fake_nvidia_smi(tmp_path / "bin", gpus=1)
    assert_refused(run(tmp_path, [bin_dir]), tmp_path, "nvidia-smi lists 1")


def test_refuses_without_vllm(tmp_path: Path) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here: the refusal cannot be seen")
    bin_dir = fake_nvidia_smi(tmp_path / "bin", gpus=2)
    assert_refused(run(tmp_path, [bin_dir]), tmp_path, "cannot import vllm and dynamo.vllm")
