"""A pure-torch Llama decoder: `transformers.LlamaForCausalLM`'s arithmetic without its import.

Importing transformers' Llama costs seconds (it pulls torch._dynamo, torch.distributed.tensor,
torch.export ...), a worker's model builds in milliseconds; this module is the same network in
torch.nn: RMSNorm, rotary embeddings in HF's rotate_half convention, grouped-query attention,
a SiLU MLP and an untied lm_head, under the same state_dict names (loaded strictly). Its
config.json is read by `llama_config`, which refuses what it does not implement. One
forward serves prefill over an optional cached prefix, a batched one-token decode with left
padding (attention mask, per-row positions) and the trainer's right-padded full pass; it
returns the logits and every layer's keys and values. The trainer uses it (autograd); the
worker serves `numpy_llama`, the same arithmetic in numpy, and tests hold the two equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dynamod.workers.cpu.errors import WorkerError
from dynamod.workers.cpu.llama_config import LlamaConfig, weight_problems

__all__ = ["LayerKV", "Llama", "LlamaConfig"]

# Per layer: (keys, values), each [batch, kv_heads, positions, head_dim], rotary applied.
LayerKV = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        dim = config.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * dim, bias=bias)
        self.o_proj = nn.Linear(heads * dim, config.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: LayerKV | None,
    ) -> tuple[torch.Tensor, LayerKV]:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        groups = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q,
            k.repeat_interleave(groups, dim=1),
            v.repeat_interleave(groups, dim=1),
            attn_mask=mask,
            scale=self.head_dim**-0.5,
        )
        out = out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        size, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(size, inner, bias=bias)
        self.up_proj = nn.Linear(size, inner, bias=bias)
        self.down_proj = nn.Linear(inner, size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: LayerKV | None,
    ) -> tuple[torch.Tensor, LayerKV]:
        attended, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class _Body(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama(nn.Module):
    """The decoder and its lm_head, under `LlamaForCausalLM`'s state_dict names."""

    inv_freq: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_dir(cls, model_dir: Path, tensors: Mapping[str, torch.Tensor]) -> Llama:
        """The model of `model_dir/config.json` holding `tensors` (strict), in eval mode."""
        config = LlamaConfig.from_file(Path(model_dir) / "config.json")
        model = cls(config)
        model.load(tensors, str(model_dir))
        return model.eval()

    def load(self, tensors: Mapping[str, torch.Tensor], source: str = "weights") -> None:
        """Every weight from `tensors`: the same names and shapes, or WorkerError."""
        expected = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        given = {name: tuple(t.shape) for name, t in tensors.items()}
        if parts := weight_problems(expected, given):
            raise WorkerError(f"{source}: weights do not fit the config: {'; '.join(parts)}")
        self.load_state_dict(dict(tensors), strict=True)

    def forward(
        self,
        input_ids: torch.Tensor,
        past: list[LayerKV] | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """(logits [batch, new, vocab], per-layer KV over past + new positions).

        `past` holds earlier positions' keys and values (all rows the same length);
        `attention_mask` [batch, past + new] is 1 where a key may be attended to (0:
        padding); `position_ids` [batch, new] default to the positions after `past`.
        """
        batch, length = input_ids.shape
        offset = int(past[0][0].shape[2]) if past else 0
        if position_ids is None:
            position_ids = torch.arange(offset, offset + length).expand(batch, length)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        mask = _attention_bias(batch, length, offset, attention_mask)
        x = self.model.embed_tokens(input_ids)
        kv: list[LayerKV] = []
        layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        for i, layer in enumerate(layers):
            x, layer_kv = layer(x, cos, sin, mask, past[i] if past else None)
            kv.append(layer_kv)
        return self.lm_head(self.model.norm(x)), kv


def _attention_bias(
    batch: int, length: int, offset: int, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """Additive mask [batch, 1, new, past + new]: causal, and padding keys shut.

    A large finite negative rather than -inf keeps a row with nothing to attend to (a
    padding query) finite, so it cannot turn a masked loss into NaN.
    """
    total = offset + length
    queries = torch.arange(offset, total)[:, None]
    allowed = (torch.arange(total)[None, :] <= queries)[None].expand(batch, length, total)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :].bool()
    bias = torch.zeros((batch, length, total))
    bias.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return bias[:, None]
