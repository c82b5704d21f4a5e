"""DeepSeek-V3 (``model_type: deepseek_v3``; Kimi K2's ``kimi_k2`` is the same architecture): transformers'
``DeepseekV3ForCausalLM``.

Multi-head latent attention (MLA): q from ``q_proj`` ``[heads * (nope + rope), H]``, or (``q_lora_rank`` set) from
``q_a_proj`` ``[q_lora, H]``, ``q_a_layernorm`` and ``q_b_proj`` ``[heads * (nope + rope), q_lora]``; keys and values
from ``kv_a_proj_with_mqa`` ``[kv_lora + rope, H]`` (its last ``rope`` rows: the one rotated key all heads share),
``kv_a_layernorm`` and ``kv_b_proj`` ``[heads * (nope + v), kv_lora]``; ``o_proj`` ``[H, heads * v]``. RoPE (YaRN, with
its mscale) turns the last ``qk_rope_head_dim`` rows of each q head and of the shared key, in interleaved pairs
(``rope_interleave``, the release) or halves. Layers below ``first_k_dense_replace`` have a dense MLP of
``intermediate_size``; the others route to ``n_routed_experts`` experts of ``moe_intermediate_size`` (router
``mlp.gate.weight`` and its trained ``mlp.gate.e_score_correction_bias``: the sigmoid scores plus the bias choose
``topk_group`` of ``n_group`` groups and then the top-k; the weights are the unbiased scores, renormalized when
``norm_topk_prob``, times ``routed_scaling_factor``) and add ``n_shared_experts`` shared experts (one MLP of
``moe_intermediate_size * n_shared_experts``). ``num_nextn_predict_layers`` multi-token-prediction layers follow the
decoder layers as ``model.layers.{num_hidden_layers + i}``: a sparse decoder layer plus ``embed_tokens``, ``enorm``,
``hnorm``, ``eh_proj`` ``[H, 2H]`` and ``shared_head.norm`` / ``shared_head.head`` (transformers drops them on load).

Every tensor is carried whole into TorchTitan's ``deepseek_v3`` (:mod:`ckptconv.titan.deepseek_v3`); there is no NxD
training model for it, so ``to-nxd`` and ``nxdtrain`` refuse it (:data:`NO_NXD`).

    >>> config = {"q_lora_rank": None, "num_attention_heads": 2, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2,
    ...           "v_head_dim": 3, "kv_lora_rank": 5, "hidden_size": 8}
    >>> MLA.hf_names_for(config)[:2]
    ('self_attn.q_proj.weight', 'self_attn.kv_a_proj_with_mqa.weight')
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptconv.core.families.base import Family, Refusal
from ckptconv.core.families.moe import ExpertNames, ExpertsRule, MoeConfig, RouterRule
from ckptconv.core.families.rules import ReplicatedRule, hidden
from ckptconv.errors import ConversionError

if TYPE_CHECKING:
    from ckptconv.core.families.rules import Shapes
    from ckptconv.core.heads import ShardRecord
    from ckptconv.core.layout import ParallelLayout
    from ckptconv.core.model_spec import ModelSpec

NO_NXD = ("there is no NxD training model for it (multi-head latent attention, shared experts, a biased "
          "group-limited router); convert it for TorchTitan with to-dcp")
NAMES = ExpertNames("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                    "mlp.experts.{e}.down_proj.weight")
BIAS = "mlp.gate.e_score_correction_bias"
MTP_KEY = "num_nextn_predict_layers"


def dim(config: dict[str, Any], key: str) -> int:
    """A positive integer of the config (MLA's dims), refused in one line otherwise."""
    value = config.get(key)
    if type(value) is not int or value <= 0:
        raise ConversionError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def q_lora(config: dict[str, Any]) -> int:
    """``q_lora_rank`` (0: q from one ``q_proj``)."""
    return 0 if config.get("q_lora_rank") is None else dim(config, "q_lora_rank")


def _mla_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, heads, rope = c["hidden_size"], dim(c, "num_attention_heads"), dim(c, "qk_rope_head_dim")
    nope, v, kv = dim(c, "qk_nope_head_dim"), dim(c, "v_head_dim"), dim(c, "kv_lora_rank")
    q_rows, q = heads * (nope + rope), q_lora(c)
    form = ({"self_attn.q_a_proj.weight": (q, h), "self_attn.q_a_layernorm.weight": (q,),
             "self_attn.q_b_proj.weight": (q_rows, q)} if q else {"self_attn.q_proj.weight": (q_rows, h)})
    return {**form,
            "self_attn.kv_a_proj_with_mqa.weight": (kv + rope, h),
            "self_attn.kv_a_layernorm.weight": (kv,),
            "self_attn.kv_b_proj.weight": (heads * (nope + v), kv),
            "self_attn.o_proj.weight": (h, heads * v)}


def _shared(c: dict[str, Any]) -> int:
    return dim(c, "moe_intermediate_size") * dim(c, "n_shared_experts")


def _mlp(prefix: str, rows: int, h: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}gate_proj.weight": (rows, h), f"{prefix}up_proj.weight": (rows, h),
            f"{prefix}down_proj.weight": (h, rows)}


@dataclass(frozen=True)
class WholeRule:
    """HF tensors carried whole, named and shaped from the config (``shapes_of``); no NxD records (:data:`NO_NXD`).
    ``hf_names_for(config)``: the names this config has (the q form of MLA)."""

    shapes_of: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    all_names: tuple[str, ...]

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.all_names

    def hf_names_for(self, config: dict[str, Any]) -> tuple[str, ...]:
        return tuple(self.shapes_of(config))

    def shapes(self, spec: ModelSpec) -> Shapes:
        return dict(self.shapes_of(spec.config))

    def records(self, spec: ModelSpec, layout: ParallelLayout, prefix: str, rank: int) -> Iterator[ShardRecord]:
        raise ConversionError(f"{spec.family.name}: {NO_NXD}")


MLA = WholeRule(_mla_shapes, ("self_attn.q_proj.weight", "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                              "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                              "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
                              "self_attn.o_proj.weight"))
DENSE = WholeRule(lambda c: _mlp("mlp.", dim(c, "intermediate_size"), c["hidden_size"]),
                  tuple(f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")))
ROUTER_BIAS = WholeRule(lambda c: {BIAS: (dim(c, "n_routed_experts"),)}, (BIAS,))
SHARED = WholeRule(lambda c: _mlp("mlp.shared_experts.", _shared(c), c["hidden_size"]),
                   tuple(f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")))
# an MTP layer's own tensors, besides its decoder layer (DeepSeek's release names)
MTP_NAMES = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
             "shared_head.head.weight")
MTP = WholeRule(lambda c: dict(zip(MTP_NAMES, ((c["vocab_size"], c["hidden_size"]), (c["hidden_size"],),
                                               (c["hidden_size"],), (c["hidden_size"], 2 * c["hidden_size"]),
                                               (c["hidden_size"],), (c["vocab_size"], c["hidden_size"])),
                                   strict=True)), MTP_NAMES)
_NORMS = (ReplicatedRule("input_layernorm.weight", hidden), ReplicatedRule("post_attention_layernorm.weight", hidden))


def _sparse(config: dict[str, Any], layer: int) -> bool:
    """Whether ``layer`` routes to experts (as ``DeepseekV3DecoderLayer`` decides; MTP layers too)."""
    return layer >= int(config.get("first_k_dense_replace") or 0)


DEEPSEEK_V3 = Family(
    model_type="deepseek_v3", name="DeepSeek-V3", hf_class="DeepseekV3ForCausalLM",
    layer_rules=(MLA, DENSE, *_NORMS),
    refusals=(Refusal("attention_bias", "q/kv/o biases are not part of DeepSeek-V3's layout (TorchTitan's MLA has "
                                        "none)"),
              Refusal("tie_word_embeddings", "DeepSeek-V3's embedding and lm_head are separate tensors"),
              Refusal("scoring_func", "DeepSeek-V3's router scores by sigmoid", lambda v: v not in (None, "sigmoid")),
              Refusal("topk_method", "DeepSeek-V3's router picks noaux_tc (the bias-corrected group top-k)",
                      lambda v: v not in (None, "noaux_tc"))),
    moe=MoeConfig("n_routed_experts", "moe_intermediate_size", NAMES, sparse=_sparse,
                  norm_topk=lambda config: bool(config.get("norm_topk_prob", False)), aliases=("num_local_experts",)),
    sparse_rules=(MLA, RouterRule(NAMES), ROUTER_BIAS, ExpertsRule(NAMES), SHARED, *_NORMS),
    no_nxd=NO_NXD,
    mtp_key=MTP_KEY,
    mtp_rules=(MTP,),
    kv_heads_key=None,
    head_dim_key="qk_rope_head_dim",
)
