"""The CPU worker as it started before it had its own Llama: transformers' model at start.

    python -m bench.hf_worker [python -m dynamod.workers.cpu flags]

Only `bench.worker_start` uses it, as the "before" side of its comparison: the worker's
own `main`, with the torch engine's model built the old way (`from transformers import
LlamaConfig, LlamaForCausalLM`, config from config.json, strict load). It measures the
start; it is not for serving (the engine's forward expects the new model's outputs).
"""

from __future__ import annotations

import sys
from typing import Any

from dynamod.workers.cpu import torch_engine
from dynamod.workers.cpu.serve import main


def _build_with_transformers(self: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(self._threads)
    config = LlamaConfig.from_json_file(str(self._model_dir / "config.json"))
    self._max_len = int(config.max_position_embeddings)
    model = LlamaForCausalLM(config)
    model.load_state_dict(dict(self._weights.tensors), strict=True)
    model.eval()
    return model


torch_engine.TorchEngine._build = _build_with_transformers  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
