"""The numbers of a model that decide how it is sharded, read from an HF ``config.json``.

Example:
    >>> spec = ModelSpec.from_config({"hidden_size": 64, "num_attention_heads": 8,
    ...     "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128,
    ...     "num_hidden_layers": 4})
    >>> spec.head_dim, spec.group
    (8, 4)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptconv.core.families import FAMILIES, Family, family_for
from ckptconv.errors import ConversionError

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # HF and NxD keys alike


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shapes of a checkpoint of family ``model_type``; ``config`` keeps the whole HF config for writing it back."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    tied: bool
    model_type: str = "llama"
    experts: int = 0               # routed experts per sparse layer (0: a dense model)
    expert_intermediate: int = 0   # one expert's intermediate size
    top_k: int = 0                 # experts per token
    mtp_layers: int = 0            # multi-token-prediction layers the weights carry after the decoder layers
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConversionError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ConversionError(
                f"config.json: num_attention_heads ({self.heads}) must be a multiple of "
                f"num_key_value_heads ({self.kv_heads})"
            )

    def check_counts(self, keys: Iterable[str], source: str) -> int:
        """The layer count agrees with the tensors present, before anything is sized by it
        (a ``num_hidden_layers: 1000000000`` config must fail here, not after gigabytes of plan). The MTP layers the
        config states may follow them, or be absent (transformers drops them): returns how many are present.

        >>> spec = ModelSpec.from_config({"hidden_size": 8, "num_attention_heads": 2,
        ...     "intermediate_size": 8, "vocab_size": 8, "num_hidden_layers": 3})
        >>> spec.check_counts(["model.layers.0.mlp.w", "model.layers.1.mlp.w"], "config.json")
        Traceback (most recent call last):
        ...
        ckptconv.errors.ConversionError: config.json: num_hidden_layers is 3 but the weights hold 2 layers (0-1)
        """
        found = {int(m.group(1)) for key in keys if (m := _LAYER_KEY.search(key))}
        for total in {self.layers, self.layers + self.mtp_layers}:
            if len(found) == total and (not found or max(found) == total - 1):
                return total - self.layers
        span = f" ({min(found)}-{max(found)})" if found else ""
        mtp = f" and {self.mtp_layers} MTP layer(s) ({self.family.mtp_key})" if self.mtp_layers else ""
        raise ConversionError(f"{source}: num_hidden_layers is {self.layers}{mtp} but the weights hold "
                              f"{len(found)} layers{span}")

    @property
    def family(self) -> Family:
        """The family entry every converter path and the trainer read (:mod:`ckptconv.core.families`)."""
        return FAMILIES[self.model_type]

    @property
    def dense_mlp_layers(self) -> int:
        """Layers with a dense (non-expert) MLP."""
        return sum(1 for layer in range(self.layers) if not self.sparse(layer))

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes to experts."""
        return bool(self.experts) and self.family.rules_for(self.config, layer) is self.family.sparse_rules

    @property
    def window(self) -> int | None:
        """Sliding attention window (keys a query sees, itself included); None: full causal attention."""
        return self.family.attention_window(self.config)

    @property
    def group(self) -> int:
        """Query heads per key/value head (GQA group size)."""
        return self.heads // self.kv_heads

    @property
    def q_rows(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelSpec:
        family = family_for(config, source)
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size",
                               "vocab_size", "num_hidden_layers") if k not in config]
        if missing:
            raise ConversionError(f"{source}: missing required field(s) {', '.join(missing)}")
        for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                    "vocab_size", "num_hidden_layers"):
            value = config.get(key)
            if value is not None and (type(value) is not int or value <= 0):
                raise ConversionError(f"{source}: {key} must be a positive integer, got {value!r}")
        heads = config["num_attention_heads"]
        kv_heads = (config.get(family.kv_heads_key) if family.kv_heads_key else None) or heads
        hidden = config["hidden_size"]
        head_dim = config.get(family.head_dim_key) or (hidden // heads if heads else 0)
        moe = _moe_numbers(family, config, source)
        return cls(
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            layers=config["num_hidden_layers"],
            tied=bool(config.get("tie_word_embeddings", False)),
            model_type=family.model_type,
            config=dict(config),
            mtp_layers=_mtp_layers(family, config, source),
            **moe,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelSpec:
        path = Path(path)
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConversionError(f"{path}: config file not found") from None
        except json.JSONDecodeError as exc:
            raise ConversionError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(config, dict):
            raise ConversionError(f"{path}: expected a JSON object, got {type(config).__name__}")
        return cls.from_config(config, source=str(path))


def _mtp_layers(family: Family, config: dict[str, Any], source: str) -> int:
    """The MTP layers a family's config states (0 for a family without)."""
    value = config.get(family.mtp_key) or 0 if family.mtp_key else 0
    if type(value) is not int or value < 0:
        raise ConversionError(f"{source}: {family.mtp_key} must be an integer >= 0, got {value!r}")
    return value


def _moe_numbers(family: Family, config: dict[str, Any], source: str) -> dict[str, int]:
    """A mixture-of-experts family's expert count, expert intermediate size and top-k, validated."""
    moe = family.moe
    if moe is None:
        return {}
    keys = (moe.experts_key_in(config), moe.intermediate_key, "num_experts_per_tok")
    for key in keys:
        value = config.get(key)
        if type(value) is not int or value <= 0:
            raise ConversionError(f"{source}: {key} must be a positive integer, got {value!r}")
    experts, intermediate, top_k = (config[k] for k in keys)
    if top_k > experts:
        raise ConversionError(f"{source}: num_experts_per_tok ({top_k}) exceeds {keys[0]} ({experts})")
    return {"experts": experts, "expert_intermediate": intermediate, "top_k": top_k}
