"""A random grouped-query Llama config with biases (the tiny model has none), which both
Llama equivalence files (test_llama.py, test_numpy_llama.py) build models from."""

from __future__ import annotations

from typing import Any

RANDOM_GQA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
    "attention_bias": True,
    "mlp_bias": True,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "pad_token_id": 0,
}

