"""A Llama config.json, read and validated: the fields the CPU worker's models implement.

Both models of the tiny Llama (`llama`, torch, for the trainer; `numpy_llama`, for the
worker) read their config here, so they refuse the same things: any feature neither
implements (rope scaling, another activation, tied embeddings, a dtype but float32) is a
WorkerError naming the file and the field, rather than something computed differently.
No torch, no numpy: plain JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamod.workers.cpu.errors import WorkerError

# config.json fields that must hold exactly these values (absent is fine: HF's default).
_REQUIRED: dict[str, object] = {
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "pretraining_tp": 1,
    "attention_dropout": 0.0,
}
_DTYPES = (None, "float32")


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Llama config.json this module implements."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    mlp_bias: bool
    pad_token_id: int | None

    @classmethod
    def from_file(cls, path: Path) -> LlamaConfig:
        """Read and validate `path`; WorkerError names the file and the field at fault."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise WorkerError(f"{path}: not a readable JSON file ({exc})") from exc
        if not isinstance(raw, dict):
            raise WorkerError(f"{path}: expected a JSON object, found {type(raw).__name__}")
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config") -> LlamaConfig:
        fields = _Fields(raw, where)
        if raw.get("model_type", "llama") != "llama":
            raise fields.refuse("model_type", "'llama'")
        for name, value in _REQUIRED.items():
            if name in raw and raw[name] != value:
                raise fields.refuse(name, repr(value))
        for name in ("dtype", "torch_dtype"):
            if raw.get(name) not in _DTYPES:
                raise fields.refuse(name, "'float32'")
        theta = _rope_theta(raw, where)
        heads = fields.integer("num_attention_heads")
        hidden = fields.integer("hidden_size")
        kv_heads = fields.integer("num_key_value_heads", heads)
        if heads % kv_heads:
            raise fields.refuse(
                "num_key_value_heads", f"a divisor of num_attention_heads ({heads})"
            )
        head_dim = raw.get("head_dim") or hidden // heads
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim % 2:
            raise fields.refuse("head_dim", "an even positive integer")
        eps = raw.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or eps <= 0:
            raise fields.refuse("rms_norm_eps", "a positive number")
        pad = raw.get("pad_token_id")
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)):
            raise fields.refuse("pad_token_id", "an integer or null")
        return cls(
            vocab_size=fields.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.integer("intermediate_size"),
            num_hidden_layers=fields.integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=fields.integer("max_position_embeddings", 2048),
            rms_norm_eps=float(eps),
            rope_theta=theta,
            attention_bias=fields.flag("attention_bias"),
            mlp_bias=fields.flag("mlp_bias"),
            pad_token_id=pad,
        )


class _Fields:
    """Typed reads of a config.json's fields; a wrong one is refused naming file and field."""

    def __init__(self, raw: Mapping[str, Any], where: str) -> None:
        self.raw, self.where = raw, where

    def refuse(self, name: str, expected: str) -> WorkerError:
        return WorkerError(
            f"{self.where}: field {name!r} is {self.raw.get(name)!r}, expected {expected} "
            "(the CPU worker's Llama implements nothing else)"
        )

    def integer(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name)
        if value is None:  # absent or null: HF's default
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.refuse(name, "a positive integer")
        return value

    def flag(self, name: str) -> bool:
        value = self.raw.get(name, False)
        if not isinstance(value, bool):
            raise self.refuse(name, "true or false")
        return value


def _rope_theta(raw: Mapping[str, Any], where: str) -> float:
    """The rotary base, from transformers 5's `rope_parameters` or 4's `rope_theta`;
    any rope type other than the original (no scaling) is refused."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta: object = raw.get("rope_theta", 10000.0)
    for name, section in (("rope_parameters", params), ("rope_scaling", scaling)):
        if section is None:
            continue
        if not isinstance(section, dict):
            raise WorkerError(f"{where}: field {name!r} is {section!r}, expected an object")
        kind = section.get("rope_type", section.get("type", "default"))
        extra = set(section) - {"rope_type", "type", "rope_theta"}
        if kind != "default" or extra:
            raise WorkerError(
                f"{where}: field {name!r} is {section!r}: only the original rotary embedding "
                "(rope_type 'default', no scaling) is implemented by the CPU worker's Llama"
            )
        theta = section.get("rope_theta", theta)
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise WorkerError(f"{where}: field 'rope_theta' is {theta!r}, expected a positive number")
    return float(theta)


def weight_problems(
    expected: Mapping[str, tuple[int, ...]], given: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """What keeps weights of these names and shapes from fitting the config's (at most five
    of each kind), for both models' one-line refusal; empty when they fit."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    wrong = sorted(n for n in set(expected) & set(given) if expected[n] != given[n])
    parts = []
    if missing:
        parts.append(f"missing {', '.join(missing[:5])}")
    if unexpected:
        parts.append(f"unexpected {', '.join(unexpected[:5])}")
    for name in wrong[:5]:
        parts.append(f"{name} has shape {given[name]}, the config needs {expected[name]}")
    return parts
