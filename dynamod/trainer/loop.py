"""The RL loop: rollouts at version v -> rewards and advantages -> AdamW step -> save
step v + 1 -> push it through dynamod -> rollouts at v + 1 ...

A run trains up to policy version `start_step + steps`. It begins at the ledger's
current version when that is further along, loading that version's checkpoint, so a
trainer restarted mid-run carries on where the stack is and never pushes an older step.
After the last push one more round of rollouts (phase "eval") runs at the final version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from dynamod.core.errors import DynamodError
from dynamod.trainer import boundary, checkpoints, grpo
from dynamod.trainer.config import TrainerConfig
from dynamod.trainer.control import Control
from dynamod.trainer.curve import write_reward_curve
from dynamod.trainer.history import HistoryWriter
from dynamod.trainer.learner import Learner
from dynamod.trainer.prompts import prompts_for_step
from dynamod.trainer.rollout import Completion, Rollouts
from dynamod.workers.weights import state_dict_digest

log = structlog.get_logger("dynamod.trainer")


class TrainerError(DynamodError):
    """The run cannot go on; the message says what disagreed and where to look."""


@dataclass(frozen=True)
class Batch:
    prompts: list[list[int]]
    completions: list[list[int]]  # folded into the policy's vocabulary
    advantages: list[float]
    rewards: list[float]
    versions: set[int | str | None]
    shards: dict[str, int]  # shard -> responses served

    @classmethod
    def from_groups(cls, groups: list[list[Completion]], vocab_size: int) -> Batch:
        flat = [c for group in groups for c in group]
        advantages = [a for g in groups for a in grpo.group_advantages([c.reward for c in g])]
        shards: dict[str, int] = {}
        for c in flat:
            shards[str(c.shard)] = shards.get(str(c.shard), 0) + 1
        return cls(
            prompts=[c.prompt_ids for c in flat],
            completions=[grpo.fold_into_vocab(c.token_ids, vocab_size) for c in flat],
            advantages=advantages,
            rewards=[c.reward for c in flat],
            versions={c.version for c in flat},
            shards=dict(sorted(shards.items())),
        )

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards)


class Trainer:
    def __init__(self, config: TrainerConfig) -> None:
        from tokenizers import Tokenizer

        started = time.monotonic()
        self.config = config
        self.control = Control(config.state_dir)
        self.tokenizer = Tokenizer.from_file(str(config.model_dir / "tokenizer.json"))
        self.target = grpo.word_start_ids(self.tokenizer.get_vocab())
        self._learner: Learner | None = None
        self.load_s = time.monotonic() - started

    @property
    def learner(self) -> Learner:
        """The model and its optimizer, built on first use: a run with no step left (a
        stack started with `trainer_steps = 0`, or a ledger at the final step) never needs
        them, and building them (torch's import included) costs ~3.5 s of CPU here."""
        if self._learner is None:
            self._learner = Learner(self.config.model_dir, self.config.lr, self.config.seed)
        return self._learner

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text).ids
        return ids

    def reward(self, token_ids: list[int]) -> float:
        return grpo.fraction_reward(
            grpo.fold_into_vocab(token_ids, self.learner.vocab_size), self.target
        )

    async def run(self) -> None:
        config = self.config
        started = time.monotonic()
        ledger = await self.control.ledger()
        begin = max(config.start_step, ledger.version)
        steps_left = max(0, config.final_step - begin)
        source = str(config.model_dir) if steps_left else "none (no step left)"
        learner = self.learner if steps_left else None  # built here: load_s below counts it
        if ledger.path is not None and learner is not None:
            try:
                digest = learner.load(Path(ledger.path))
            except DynamodError as exc:
                raise TrainerError(
                    f"cannot resume from the ledger's version {ledger.version}: {exc}"
                ) from exc
            if ledger.digest is not None and digest != ledger.digest:
                raise TrainerError(
                    f"cannot resume: {ledger.path} has digest {digest}, the ledger recorded "
                    f"{ledger.digest} for version {ledger.version} (was it overwritten?)"
                )
            source = ledger.path
        log.info(
            "trainer.ready",
            ledger_version=ledger.version,
            first_step=begin + 1,
            final_step=config.final_step,
            steps_left=steps_left,
            weights=source,
            history=str(config.history),
            load_s=round(self.load_s + time.monotonic() - started, 2),
        )
        history = HistoryWriter(config.history)
        timeout = aiohttp.ClientTimeout(total=config.request_timeout)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                rollouts = Rollouts(
                    session,
                    self.control,
                    history,
                    frontend=config.frontend,
                    model=config.model,
                    max_tokens=config.max_tokens,
                    attempts=config.request_attempts,
                    encode=self.encode,
                    reward=self.reward,
                    seed=config.seed,
                )
                for step in range(begin + 1, config.final_step + 1):
                    await self.step(step, rollouts)
                if begin < config.final_step:
                    await self.evaluate(config.final_step + 1, rollouts)
        finally:
            history.close()
            if config.history.exists():
                curve = write_reward_curve(config.history)
                log.info("trainer.curve", png=str(curve))
        log.info(
            "trainer.done", final_step=config.final_step, run_s=round(time.monotonic() - started, 2)
        )

    async def step(self, step: int, rollouts: Rollouts) -> None:
        config, learner = self.config, self.learner
        t0 = time.monotonic()
        prompts = [self.encode(p) for p in prompts_for_step(step, config.prompts_per_step)]
        rollouts.round = step
        groups = await rollouts.groups(prompts, config.group_size, phase="train")
        batch = Batch.from_groups(groups, learner.vocab_size)
        report = self.check_boundary(step, groups)
        t1 = time.monotonic()
        loss = learner.step(batch.prompts, batch.completions, batch.advantages)
        tensors = learner.tensors()
        digest = state_dict_digest(tensors)
        path = checkpoints.save_step(config.checkpoint_dir, step, tensors)
        t2 = time.monotonic()
        push = await self.control.push(step, path)
        if push.digest is not None and push.digest != digest:
            raise TrainerError(
                f"step {step}: the shards report digest {push.digest} for {path}, the "
                f"trainer saved {digest}; see the workers' logs"
            )
        removed = checkpoints.prune(config.checkpoint_dir, config.keep)
        log.info(
            "trainer.step",
            step=step,
            rollout_version=_one(batch.versions),
            mean_reward=round(batch.mean_reward, 4),
            loss=round(loss, 6),
            responses=len(batch.rewards),
            served_by=batch.shards,
            push_s=round(push.seconds, 3),
            ack_ms=push.ack_ms,
            stale=push.stale,
            logprob_max_abs_diff=report.max_abs_diff,
            digest=digest[:12],
            checkpoint=str(path),
            pruned=[p.name for p in removed],
            rollout_s=round(t1 - t0, 3),
            train_s=round(t2 - t1, 3),
            step_s=round(time.monotonic() - t0, 3),
        )

    def check_boundary(self, step: int, groups: list[list[Completion]]) -> boundary.BoundaryReport:
        """Boundary 1: the engine's logprobs against the trainer's, under the same weights
        (the learner holds the weights the rollouts were served at); raises on a mismatch."""
        flat = [c for group in groups for c in group]
        # Folded, so a mocker's out-of-vocabulary ids fail as "no logprobs", not an IndexError.
        vocab = self.learner.vocab_size
        recomputed = self.learner.score(
            [c.prompt_ids for c in flat], [grpo.fold_into_vocab(c.token_ids, vocab) for c in flat]
        )
        report = boundary.check(
            [
                boundary.Scored(c.token_ids, c.logprobs, r, c.cancelled)
                for c, r in zip(flat, recomputed, strict=True)
            ]
        )
        log.info(
            "trainer.boundary",
            step=step,
            ok=report.ok,
            terminal=report.terminal,
            cancelled=report.cancelled,
            tokens=report.tokens,
            max_abs_diff=report.max_abs_diff,
            tolerance=boundary.LOGPROB_TOLERANCE,
        )
        if not report.ok:
            raise TrainerError(
                f"step {step}: the engine's logprobs do not match the trainer's under the "
                f"weights of version {step - 1} ({len(report.mismatches)} completion(s)); "
                f"first: {report.mismatches[0]}. A shard serves other weights than it "
                "reports, or the engine scores tokens differently: see the workers' logs"
            )
        return report

    async def evaluate(self, seed: int, rollouts: Rollouts) -> None:
        """Rollouts at the final version (no update): the last push is served."""
        config = self.config
        rollouts.round = seed
        prompts = [self.encode(p) for p in prompts_for_step(seed, config.prompts_per_step)]
        groups = await rollouts.groups(prompts, config.group_size, phase="eval")
        batch = Batch.from_groups(groups, self.learner.vocab_size)
        log.info(
            "trainer.eval",
            rollout_version=_one(batch.versions),
            mean_reward=round(batch.mean_reward, 4),
            responses=len(batch.rewards),
            served_by=batch.shards,
        )


def _one(versions: set[Any]) -> Any:
    """The single version a batch was served at (a sorted list if, unexpectedly, several)."""
    return next(iter(versions)) if len(versions) == 1 else sorted(versions, key=str)
