"""tests/conftest.py's extra_venv: under `make test` the tests that need an extra venv wait
for make to say it is made, and fail in one line when make says it failed or never does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import conftest


def test_a_made_venv_is_used_and_none_is_waited_for_outside_make(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("DYNAMOD_TEST_VENVS_MADE", raising=False)
    assert conftest.extra_venv(".venv-vllm", "vllm") == conftest.ROOT / ".venv-vllm"
    monkeypatch.setenv("DYNAMOD_TEST_VENVS_MADE", str(tmp_path))
    (tmp_path / "aiperf").touch()
    assert conftest.extra_venv(".venv-aiperf", "aiperf") == conftest.ROOT / ".venv-aiperf"


def test_a_failed_install_fails_the_test_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DYNAMOD_TEST_VENVS_MADE", str(tmp_path))
    (tmp_path / "vllm.failed").touch()
    with pytest.raises(pytest.fail.Exception, match=r"could not make \.venv-vllm"):
        conftest.extra_venv(".venv-vllm", "vllm")


def test_a_venv_never_made_fails_after_the_wait(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DYNAMOD_TEST_VENVS_MADE", str(tmp_path))
    monkeypatch.setattr(conftest, "VENV_WAIT_S", 0.0)
    with pytest.raises(pytest.fail.Exception, match="not made within 0 s"):
        conftest.extra_venv(".venv-vllm", "vllm")
