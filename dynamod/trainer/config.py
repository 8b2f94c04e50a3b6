"""The trainer's options: command line -> TrainerConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from dynamod.core.paths import STATE_DIR_ENV, default_state_dir


@dataclass(frozen=True)
class TrainerConfig:
    frontend: str
    model: str
    model_dir: Path
    checkpoint_dir: Path
    history: Path
    state_dir: Path
    steps: int
    keep: int
    group_size: int
    prompts_per_step: int
    max_tokens: int
    start_step: int
    lr: float
    seed: int
    request_timeout: float
    request_attempts: int

    @property
    def final_step(self) -> int:
        """The policy version the run ends at: --start-step plus --steps."""
        return self.start_step + self.steps


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynamod.trainer",
        description=(
            "A small GRPO trainer against a running dynamod stack: generates through the "
            "Dynamo frontend at the current policy version, takes an AdamW step on the "
            "model, saves it and pushes it to every rollout shard with `dynamod policy push`."
        ),
    )
    p.add_argument("--frontend", required=True, help="Dynamo frontend URL, http://HOST:PORT")
    p.add_argument("--model", required=True, help="served model name (as in /v1/models)")
    p.add_argument("--model-dir", type=Path, required=True, help="the model directory")
    p.add_argument(
        "--checkpoint-dir", type=Path, required=True, help="where step-<N>/ directories go"
    )
    p.add_argument(
        "--history",
        type=Path,
        help="JSONL file, one line per request (default: CHECKPOINT_DIR/history.jsonl)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"the dynamod state dir (default: ${STATE_DIR_ENV} or dynamod's default)",
    )
    p.add_argument(
        "--steps",
        type=_non_negative,
        default=5,
        help="train until policy version START_STEP + STEPS (a restarted trainer resumes "
        "from the ledger's version and runs only what is left)",
    )
    p.add_argument("--start-step", type=_non_negative, default=0, help="version the run starts at")
    p.add_argument("--keep", type=_positive, default=3, help="step directories kept (default 3)")
    p.add_argument("--group-size", type=_positive, default=4, help="completions per prompt")
    p.add_argument("--prompts-per-step", type=_positive, default=4)
    p.add_argument("--max-tokens", type=_positive, default=16, help="tokens per completion")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="torch seed")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument(
        "--request-attempts", type=_positive, default=5, help="tries per request (5xx, errors)"
    )
    return p


def parse_args(argv: list[str]) -> TrainerConfig:
    args = parser().parse_args(argv)
    checkpoint_dir: Path = args.checkpoint_dir.absolute()
    return TrainerConfig(
        frontend=args.frontend.rstrip("/"),
        model=args.model,
        model_dir=args.model_dir.absolute(),
        checkpoint_dir=checkpoint_dir,
        history=(args.history or checkpoint_dir / "history.jsonl").absolute(),
        state_dir=args.state_dir or default_state_dir(),
        steps=args.steps,
        keep=args.keep,
        group_size=args.group_size,
        prompts_per_step=args.prompts_per_step,
        max_tokens=args.max_tokens,
        start_step=args.start_step,
        lr=args.lr,
        seed=args.seed,
        request_timeout=args.request_timeout,
        request_attempts=args.request_attempts,
    )
