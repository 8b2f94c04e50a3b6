"""The worker's Llama decoder in numpy: `llama.Llama`'s forward without torch.

Importing torch cost a worker start over 2 CPU-seconds; serving needs no autograd, so
the worker runs the same network here, in float32 numpy: embeddings, RMSNorm, rotary
embeddings in HF's rotate_half convention (default rope only), grouped-query attention
with an additive mask, a SiLU MLP and an untied lm_head, from the same state_dict names
(loaded strictly, refused by name as `llama.Llama.load` refuses them) and the same
config.json (`llama_config`). One forward serves prefill over an optional cached prefix
and a batched one-token decode with left padding (attention mask, per-row positions); it
returns the logits and every layer's keys and values [batch, kv_heads, positions,
head_dim]. tests/unit/test_numpy_llama.py holds it equal to `llama.Llama` within 1e-5.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dynamod.workers.cpu.errors import WorkerError
from dynamod.workers.cpu.llama_config import LlamaConfig, weight_problems

Array = npt.NDArray[np.float32]
# Per layer: (keys, values), each [batch, kv_heads, positions, head_dim], rotary applied.
LayerKV = tuple[Array, Array]

_MASKED = np.finfo(np.float32).min  # finite, as llama.py: a padding query stays finite


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `LlamaForCausalLM` holds for `config`, by state_dict name."""
    hidden, inner = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    projections = {
        "self_attn.q_proj": (q_size, hidden, config.attention_bias),
        "self_attn.k_proj": (kv_size, hidden, config.attention_bias),
        "self_attn.v_proj": (kv_size, hidden, config.attention_bias),
        "self_attn.o_proj": (hidden, q_size, config.attention_bias),
        "mlp.gate_proj": (inner, hidden, config.mlp_bias),
        "mlp.up_proj": (inner, hidden, config.mlp_bias),
        "mlp.down_proj": (hidden, inner, config.mlp_bias),
    }
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        for name, (out, inp, bias) in projections.items():
            shapes[f"{prefix}{name}.weight"] = (out, inp)
            if bias:
                shapes[f"{prefix}{name}.bias"] = (out,)
    return shapes


class _Linear:
    """x @ weight.T + bias, the weight transposed once at load."""

    def __init__(self, tensors: Mapping[str, Array], name: str) -> None:
        self.weight_t = np.ascontiguousarray(tensors[name + ".weight"].T)
        bias = tensors.get(name + ".bias")
        self.bias = None if bias is None else bias

    def __call__(self, x: Array) -> Array:
        out: Array = x @ self.weight_t
        if self.bias is not None:
            out = out + self.bias
        return out


class _Layer:
    def __init__(self, tensors: Mapping[str, Array], prefix: str) -> None:
        self.input_norm = tensors[prefix + "input_layernorm.weight"]
        self.post_norm = tensors[prefix + "post_attention_layernorm.weight"]
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        self.q, self.k, self.v, self.o = (
            _Linear(tensors, attn + p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        )
        self.gate, self.up, self.down = (
            _Linear(tensors, mlp + p) for p in ("gate_proj", "up_proj", "down_proj")
        )


class NumpyLlama:
    """The decoder and its lm_head, from `LlamaForCausalLM`'s state_dict (numpy float32)."""

    def __init__(self, config: LlamaConfig, tensors: Mapping[str, Any], source: str) -> None:
        self.config = config
        self._check(tensors, source)
        arrays = {name: np.asarray(t, dtype=np.float32) for name, t in tensors.items()}
        self._embed = arrays["model.embed_tokens.weight"]
        self._norm = arrays["model.norm.weight"]
        self._lm_head = _Linear(arrays, "lm_head")
        self._layers = [
            _Layer(arrays, f"model.layers.{i}.") for i in range(config.num_hidden_layers)
        ]
        dim = config.head_dim
        exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        self._inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponent)).astype(
            np.float32
        )
        self._eps = np.float32(config.rms_norm_eps)
        self._scale = np.float32(dim**-0.5)

    @classmethod
    def from_dir(cls, model_dir: Path, tensors: Mapping[str, Any]) -> NumpyLlama:
        """The model of `model_dir/config.json` holding `tensors` (strict)."""
        config = LlamaConfig.from_file(Path(model_dir) / "config.json")
        return cls(config, tensors, str(model_dir))

    def _check(self, tensors: Mapping[str, Any], source: str) -> None:
        check_fit(self.config, tensors, source)

    def _rms_norm(self, x: Array, weight: Array) -> Array:
        variance = np.mean(x * x, axis=-1, keepdims=True)
        normed: Array = weight * (x * (np.float32(1.0) / np.sqrt(variance + self._eps)))
        return normed

    def __call__(
        self,
        input_ids: npt.NDArray[np.int64],
        past: list[LayerKV] | None = None,
        attention_mask: npt.NDArray[np.int64] | None = None,
        position_ids: npt.NDArray[np.int64] | None = None,
    ) -> tuple[Array, list[LayerKV]]:
        """(logits [batch, new, vocab], per-layer KV over past + new positions).

        `past` holds earlier positions' keys and values (all rows the same length);
        `attention_mask` [batch, past + new] is 1 where a key may be attended to (0:
        padding); `position_ids` [batch, new] default to the positions after `past`.
        """
        config = self.config
        batch, length = input_ids.shape
        offset = int(past[0][0].shape[2]) if past else 0
        if position_ids is None:
            position_ids = np.broadcast_to(np.arange(offset, offset + length), (batch, length))
        freqs = position_ids[..., None].astype(np.float32) * self._inv_freq
        emb = np.concatenate((freqs, freqs), axis=-1)
        cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]  # [batch, 1, new, head_dim]
        mask = _attention_bias(batch, length, offset, attention_mask)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        dim = config.head_dim
        groups = heads // kv_heads
        x: Array = self._embed[input_ids]
        kv: list[LayerKV] = []
        for i, layer in enumerate(self._layers):
            h = self._rms_norm(x, layer.input_norm)
            q = layer.q(h).reshape(batch, length, heads, dim).transpose(0, 2, 1, 3)
            k = layer.k(h).reshape(batch, length, kv_heads, dim).transpose(0, 2, 1, 3)
            v = layer.v(h).reshape(batch, length, kv_heads, dim).transpose(0, 2, 1, 3)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if past:
                k = np.concatenate([past[i][0], k], axis=2)
                v = np.concatenate([past[i][1], v], axis=2)
            kv.append((k, v))
            keys = np.repeat(k, groups, axis=1) if groups > 1 else k
            values = np.repeat(v, groups, axis=1) if groups > 1 else v
            scores = (q @ keys.transpose(0, 1, 3, 2)) * self._scale + mask
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            attended = (scores @ values).transpose(0, 2, 1, 3).reshape(batch, length, heads * dim)
            x = x + layer.o(attended)
            h = self._rms_norm(x, layer.post_norm)
            x = x + layer.down(_silu(layer.gate(h)) * layer.up(h))
        return self._lm_head(self._rms_norm(x, self._norm)), kv


def _silu(x: Array) -> Array:
    out: Array = (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32, copy=False)
    return out


def _rotate_half(x: Array) -> Array:
    half = x.shape[-1] // 2
    return np.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def _attention_bias(
    batch: int, length: int, offset: int, attention_mask: npt.NDArray[np.int64] | None
) -> Array:
    """Additive mask [batch, 1, new, past + new]: causal, and padding keys shut."""
    total = offset + length
    queries = np.arange(offset, total)[:, None]
    allowed = np.broadcast_to((np.arange(total)[None, :] <= queries)[None], (batch, length, total))
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :].astype(bool)
    bias = np.where(allowed, np.float32(0.0), _MASKED).astype(np.float32)
    return bias[:, None]


def check_fit(config: LlamaConfig, tensors: Mapping[str, Any], source: str) -> None:
    """The same names and shapes as the config needs, float32, or WorkerError naming
    `source` and what does not fit."""
    expected = expected_shapes(config)
    given = {name: tuple(int(d) for d in t.shape) for name, t in tensors.items()}
    not_f32 = sorted(n for n in given if str(tensors[n].dtype) != "float32")
    parts = weight_problems(expected, given) + [
        f"{name} is {tensors[name].dtype}, the numpy engine needs float32"
        for name in not_f32[:5]
    ]
    if parts:
        raise WorkerError(f"{source}: weights do not fit the config: {'; '.join(parts)}")
