"""`python -m dynamod.trainer`: exit 0 after the run, 1 if it failed, 2 on bad input."""

from __future__ import annotations

import asyncio
import os
import sys

import structlog

from dynamod.core import logsetup
from dynamod.core.errors import DynamodError
from dynamod.trainer.config import parse_args
from dynamod.trainer.loop import Trainer
from dynamod.workers.model import ModelDirError, check_model_dir

log = structlog.get_logger("dynamod.trainer")


def main(argv: list[str] | None = None) -> int:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model directory is all there is
    logsetup.configure()
    try:
        check_model_dir(config.model_dir)
    except ModelDirError as exc:
        log.error("trainer.bad_input", error=str(exc))
        return 2
    try:
        asyncio.run(Trainer(config).run())
    except DynamodError as exc:
        log.error("trainer.failed", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
