"""verl's own trainer (`python -m verl.trainer.main_ppo`) against a running dynamod stack.

    python -m dynamod.integrations.verl.run STATE_DIR [--steps N] [--ranks N]
        [--data DIR] [--val-only] [-- OVERRIDE ...]

reads the stack from its daemon (the shards' model, the Ray head's address), builds the
tiny dataset under DIR when it is not there (`dataset.py`), and runs `main_ppo` with
GRPO, FSDP2, rollout `dynamod` and the given number of steps and trainer ranks; the
overrides after `--` come last, so any of these can be changed. The stack may be any
that has rollout shards under its [policy] table and a `ray-head` unit (verl-cpu.toml,
a stack of real `dynamo.vllm` shards, or a cluster stack with the Ray units, run on its
head): nothing here knows which engine serves.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dynamod.integrations.verl import ROLLOUT_NAME, reward
from dynamod.integrations.verl.attach import ray_env
from dynamod.integrations.verl.errors import StackNotReadyError
from dynamod.integrations.verl.stack import StackView, read_stack

MAIN = "verl.trainer.main_ppo"


def overrides(view: StackView, data_dir: Path, steps: int, ranks: int,
              val_only: bool = False) -> list[str]:
    """main_ppo's Hydra overrides for a short GRPO run on this stack."""
    if view.model_path is None:
        raise StackNotReadyError(
            f"dynamod stack {view.stack!r}: its shards' command lines name no model path "
            "(--model-path / --model); give actor_rollout_ref.model.path after `--`"
        )
    if view.ray_address is None:
        raise StackNotReadyError(
            f"dynamod stack {view.stack!r} has no `ray-head` unit; use units/stacks/verl-cpu.toml"
        )
    batch = 2 * ranks
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'val.parquet'}",
        f"data.train_batch_size={batch}",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={view.model_path}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"+actor_rollout_ref.rollout.engine_kwargs.dynamod.state_dir={view.state_dir}",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={reward.__file__}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.device=cpu",
        "trainer.use_v1=False",
        "trainer.logger=[console]",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={ranks}",
        f"trainer.total_training_steps={steps}",
        f"trainer.val_before_train={val_only}",
        f"trainer.val_only={val_only}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={view.state_dir / 'verl' / 'trainer'}",
        f"+ray_kwargs.ray_init.address={view.ray_address}",
        f"hydra.run.dir={view.state_dir / 'verl' / 'hydra'}",
    ]


def command(state_dir: Path, data_dir: Path, steps: int, ranks: int, val_only: bool = False,
            extra: list[str] | None = None) -> list[str]:
    """The main_ppo command line (this interpreter) for the stack at `state_dir`."""
    return command_of(read_stack(state_dir), data_dir, steps, ranks, val_only, extra)


def command_of(view: StackView, data_dir: Path, steps: int, ranks: int,
               val_only: bool = False, extra: list[str] | None = None) -> list[str]:
    """The main_ppo command line for the stack `view` shows."""
    return [sys.executable, "-m", MAIN,
            *overrides(view, data_dir, steps, ranks, val_only), *(extra or [])]


def environment(base: dict[str, str] | None = None,
                ray_address: str | None = None) -> dict[str, str]:
    """The driver's environment: Ray on loopback, or on a cluster's head at `ray_address`
    (read when ray is imported)."""
    return {**(os.environ if base is None else base), **ray_env(ray_address)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynamod.integrations.verl.run",
        description=__doc__.splitlines()[0], epilog="-- OVERRIDE ...: Hydra overrides for main_ppo",
    )
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--val-only", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:  # main_ppo's Hydra overrides, passed on as they are
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    from dynamod.integrations.verl import dataset

    data_dir = args.data or args.state_dir / "verl" / "data"
    try:  # one read of the stack: the command and where its Ray is
        view = read_stack(args.state_dir)
        cmd = command_of(view, data_dir, args.steps, args.ranks, args.val_only, extra)
    except StackNotReadyError as exc:
        print(f"dynamod.integrations.verl.run: {exc}", file=sys.stderr)
        return 2
    if not (data_dir / "train.parquet").exists():
        dataset.write(data_dir)
    os.execve(cmd[0], cmd, environment(ray_address=view.ray_address))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
