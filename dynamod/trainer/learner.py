"""The policy being trained: the model directory's Llama on CPU, and its AdamW optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynamod.trainer import grpo
from dynamod.trainer.scoring import completion_logprobs, padded_rows
from dynamod.workers.weights import load_checkpoint


class Learner:
    """The worker's Llama (`dynamod.workers.cpu.llama`, the same network and tensor names
    as `transformers.LlamaForCausalLM`) built from the model directory's config, holding
    the weights a checkpoint (or the directory itself) gives it. Offline: nothing is
    fetched, the config and tensors are read from disk."""

    def __init__(self, model_dir: Path, lr: float, seed: int) -> None:
        import torch

        from dynamod.workers.cpu.llama import Llama, LlamaConfig

        # One thread: the trainer shares the cores with the workers, and torch's spinning
        # intra-op threads slow everyone down more than they speed up a model this small.
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        config = LlamaConfig.from_file(model_dir / "config.json")
        self.model = Llama(config)
        self.vocab_size = config.vocab_size
        self.pad_id = config.pad_token_id or 0
        self.load(model_dir)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def load(self, checkpoint: Path) -> str:
        """Replace every weight with the checkpoint's (strict: same names, same shapes);
        returns the checkpoint's digest."""
        weights = load_checkpoint(checkpoint)
        self.model.load(weights.tensors, str(weights.source))
        return weights.digest

    def tensors(self) -> dict[str, Any]:
        """The weights under the names the model directory (and a rollout worker) uses."""
        return {name: t.detach() for name, t in self.model.state_dict().items()}

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """The logprobs of each completion's tokens under the current weights (no step)."""
        return completion_logprobs(self.model, prompts, completions, self.pad_id)

    def step(
        self, prompts: list[list[int]], completions: list[list[int]], advantages: list[float]
    ) -> float:
        """One AdamW step on -(advantage * mean completion log-prob); returns the loss.

        Completion ids must already lie in the vocabulary (see `grpo.fold_into_vocab`).
        """
        import torch

        rows = [p + c for p, c in zip(prompts, completions, strict=True)]
        input_ids, attention = padded_rows(rows, self.pad_id)
        length = int(input_ids.shape[1])
        logits, _ = self.model(input_ids, attention_mask=attention)
        logprobs = grpo.token_logprobs(logits, input_ids)
        mask = grpo.completion_mask(
            [len(p) for p in prompts], [len(c) for c in completions], length
        )
        loss = grpo.policy_loss(logprobs, mask, torch.tensor(advantages, dtype=torch.float32))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.item())
