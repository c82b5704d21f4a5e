"""GPT-OSS (``model_type: gpt_oss``): transformers' ``GptOssForCausalLM``, a mixture of experts in every layer with
per-head attention sinks, biases on q/k/v/o, on the router and on both expert projections, and sliding-window and
full attention alternating by ``layer_types``.

Its names are transformers 5's (what it saves, and what the MXFP4 release dequantizes to): per layer
``self_attn.sinks`` ``[heads]``, ``mlp.router.{weight,bias}`` ``[E, H]``/``[E]``, ``mlp.experts.gate_up_proj``
``[E, H, 2I]`` (input first; gate and up **interleaved** column by column: gate ``[..., 0::2]``, up ``[..., 1::2]``)
with ``gate_up_proj_bias`` ``[E, 2I]``, ``mlp.experts.down_proj`` ``[E, I, H]`` with ``down_proj_bias`` ``[E, H]``.
Each is carried whole (TorchTitan's ``gpt_oss`` keeps them stacked: :mod:`ckptconv.titan.gpt_oss`); there is no
NxD training model for it, so ``to-nxd`` and ``nxdtrain`` refuse it (:data:`NO_NXD`) and point to ``to-dcp``.

    >>> [n for n in GPT_OSS.layer_keys if "experts" in n]
    ['mlp.experts.gate_up_proj', 'mlp.experts.gate_up_proj_bias', 'mlp.experts.down_proj', 'mlp.experts.down_proj_bias']
    >>> layer_window({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128}, 1) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptconv.core.families.base import Family, Refusal
from ckptconv.errors import ConversionError

if TYPE_CHECKING:
    from ckptconv.core.families.rules import Shapes
    from ckptconv.core.heads import ShardRecord
    from ckptconv.core.layout import ParallelLayout
    from ckptconv.core.model_spec import ModelSpec

NO_NXD = ("there is no NxD training model for it (attention sinks, biased experts, interleaved gate/up); "
          "convert it for TorchTitan with to-dcp")
LAYER_TYPES = ("sliding_attention", "full_attention")
ALPHA = 1.702  # transformers' default swiglu_alpha (the value TorchTitan 0.3.0's swiglu hard-codes)


def experts_of(spec: ModelSpec) -> tuple[int, int]:
    """``(E, top-k)`` of a GPT-OSS config, each a positive integer, top-k at most E."""
    values = []
    for key in ("num_local_experts", "num_experts_per_tok"):
        value = spec.config.get(key)
        if type(value) is not int or value <= 0:
            raise ConversionError(f"config.json: {key} must be a positive integer, got {value!r}")
        values.append(value)
    if values[1] > values[0]:
        raise ConversionError(f"config.json: num_experts_per_tok ({values[1]}) exceeds num_local_experts ({values[0]})")
    return values[0], values[1]


def layer_window(config: dict[str, Any], layer: int) -> int | None:
    """Keys a query of ``layer`` sees, itself included: ``sliding_window`` on a ``sliding_attention`` layer, None (all
    earlier ones) on a ``full_attention`` one (as ``GptOssAttention`` decides)."""
    types = config.get("layer_types")
    if not isinstance(types, list) or types[layer] != "sliding_attention":
        return None
    return int(config["sliding_window"])


def _bad_layer_types(types: Any) -> bool:
    return not isinstance(types, list) or any(t not in LAYER_TYPES for t in types)


def _bad_window(window: Any) -> bool:
    return window is not None and (type(window) is not int or window <= 0)


@dataclass(frozen=True)
class WholeRule:
    """A GPT-OSS tensor carried whole (its shape from the spec); it has no NxD records (:data:`NO_NXD`)."""

    name: str
    shape: Callable[[ModelSpec], tuple[int, ...]]

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.name,)

    def shapes(self, spec: ModelSpec) -> Shapes:
        return {self.name: self.shape(spec)}

    def records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]:
        raise ConversionError(f"{spec.family.name}: {NO_NXD}")


def _e(spec: ModelSpec) -> int:
    return experts_of(spec)[0]


# In transformers' module order (GptOssDecoderLayer's state_dict: sinks registered before the projections' use).
_RULES = (
    WholeRule("self_attn.sinks", lambda s: (s.heads,)),
    WholeRule("self_attn.q_proj.weight", lambda s: (s.q_rows, s.hidden)),
    WholeRule("self_attn.q_proj.bias", lambda s: (s.q_rows,)),
    WholeRule("self_attn.k_proj.weight", lambda s: (s.kv_rows, s.hidden)),
    WholeRule("self_attn.k_proj.bias", lambda s: (s.kv_rows,)),
    WholeRule("self_attn.v_proj.weight", lambda s: (s.kv_rows, s.hidden)),
    WholeRule("self_attn.v_proj.bias", lambda s: (s.kv_rows,)),
    WholeRule("self_attn.o_proj.weight", lambda s: (s.hidden, s.q_rows)),
    WholeRule("self_attn.o_proj.bias", lambda s: (s.hidden,)),
    WholeRule("mlp.router.weight", lambda s: (_e(s), s.hidden)),
    WholeRule("mlp.router.bias", lambda s: (_e(s),)),
    WholeRule("mlp.experts.gate_up_proj", lambda s: (_e(s), s.hidden, 2 * s.intermediate)),
    WholeRule("mlp.experts.gate_up_proj_bias", lambda s: (_e(s), 2 * s.intermediate)),
    WholeRule("mlp.experts.down_proj", lambda s: (_e(s), s.intermediate, s.hidden)),
    WholeRule("mlp.experts.down_proj_bias", lambda s: (_e(s), s.hidden)),
    WholeRule("input_layernorm.weight", lambda s: (s.hidden,)),
    WholeRule("post_attention_layernorm.weight", lambda s: (s.hidden,)),
)

GPT_OSS = Family(
    model_type="gpt_oss", name="GPT-OSS", hf_class="GptOssForCausalLM", layer_rules=_RULES,
    refusals=(Refusal("layer_types", f"each layer's type must be one of {', '.join(LAYER_TYPES)}", _bad_layer_types),
              Refusal("sliding_window", "must be a positive integer (keys a sliding layer's query sees)", _bad_window)),
    no_nxd=NO_NXD,
)
