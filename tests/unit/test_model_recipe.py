"""The tiny model's recipe: a directory dynamod built from an older recipe (head_dim 16,
which vLLM's CPU attention refuses) is rebuilt; anyone else's is never touched, and
`vllm_fit_problem` says what vLLM cannot serve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dynamod.workers.model import (
    BUILT_MARKER,
    MARKER_TEXT,
    ModelDirError,
    ensure_model,
    vllm_fit_problem,
)


def test_the_tiny_model_fits_vllm(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["head_dim"] == 64 and config["hidden_size"] == 256
    assert vllm_fit_problem(tiny_dir) is None
    assert (tiny_dir / BUILT_MARKER).read_text() == MARKER_TEXT


def test_an_older_recipe_is_rebuilt_in_place(tiny_dir: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(tiny_dir, old)
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "head_dim": 16, "hidden_size": 64}))
    (old / BUILT_MARKER).write_text("built by python -m dynamod.workers.model\n")
    assert vllm_fit_problem(old) is None  # the stack's model unit rebuilds it
    ensure_model(old)
    assert json.loads((old / "config.json").read_text())["head_dim"] == 64
    assert (old / BUILT_MARKER).read_text() == MARKER_TEXT


def test_someone_elses_narrow_model_is_refused_not_rebuilt(tiny_dir: Path, tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    shutil.copytree(tiny_dir, theirs)
    (theirs / BUILT_MARKER).unlink()
    config = json.loads((theirs / "config.json").read_text())
    (theirs / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    assert ensure_model(theirs) == theirs  # complete: left untouched
    assert json.loads((theirs / "config.json").read_text())["head_dim"] == 16
    problem = vllm_fit_problem(theirs)
    assert problem is not None and "head_dim 16" in problem and "32..512" in problem
    (theirs / "config.json").unlink()
    assert vllm_fit_problem(theirs) == f"{theirs} has no config.json"
    with pytest.raises(ModelDirError, match="was not built by dynamod"):
        ensure_model(theirs)
    assert vllm_fit_problem(tmp_path / "absent") is None  # built by the model unit
