"""Fixtures the unit tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamod.workers.model import ensure_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model the builder writes, built once per module that asks for it."""
    return ensure_model(tmp_path_factory.mktemp("model") / "tiny")
