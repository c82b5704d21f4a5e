"""TorchTitan's llama3 and qwen3 names and row order, as one rule table keyed by the HF names (with its inverse).

TorchTitan (pinned: :data:`TITAN_VERSION`) saves a Llama model (its ``llama3``) under its own parameter names,
and that model's complex RoPE rotates interleaved row pairs ``(2i, 2i+1)`` of each q/k head where HF rotates
``(i, i + head_dim/2)``: so q and k rows are permuted head by head (the inverse of the permutation
in HF's conversion script). Its ``qwen3`` (Qwen3 dense: the same names plus ``attention.q_norm``/``k_norm``)
rotates halves with its cos/sin RoPE, as HF does: no rows move. Its ``qwen3`` MoE (Qwen3-MoE) replaces a sparse
layer's ``feed_forward`` by ``moe``: the experts stacked in HF orientation (``w1_EFD``/``w3_EFD`` ``[E, I, H]``: gate,
up; ``w2_EDF`` ``[E, H, I]``: down), the router ``moe.router.gate.weight`` ``[E, H]`` and the fp32 buffer
``moe.expert_bias_E`` ``[E]`` of its auxiliary-loss-free load balancing (no HF counterpart: written as zeros, see
:func:`moe_params`). Nothing here is specific to weights: a rule maps *any* per-parameter tensor whose rows are
the parameter's rows (an AdamW moment, an fp32 master) the same way.

    >>> titan_name("model.layers.3.mlp.down_proj.weight")
    'layers.3.feed_forward.w2.weight'
    >>> hf_name("layers.3.attention.qkv_linear.wq.weight")
    'model.layers.3.self_attn.q_proj.weight'
    >>> rope_rows(4)   # titan row i of a head is HF row rope_rows(hd)[i] of that head
    (0, 2, 1, 3)
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Collection
from dataclasses import dataclass
from functools import cache

from ckptconv.core.mapping import EMBED, LM_HEAD, hf_shapes
from ckptconv.core.model_spec import ModelSpec
from ckptconv.errors import ConversionError

TITAN_VERSION = "0.3.0"
TITAN_MODEL = "llama3"


@dataclass(frozen=True)
class TitanModel:
    """A TorchTitan model a family maps onto: its name (``--module``), whether its RoPE is the complex one
    (q/k rows permuted), and the HF -> TorchTitan rules its layers add to the common ones."""

    name: str
    complex_rope: bool
    extra_layer_rules: tuple[NameRule, ...] = ()
    # a model whose keys a module of its own lists (``titan_params(spec)``, ``shared_copies(spec)``), imported when used
    module: str | None = None


def _qk_norms() -> tuple[NameRule, ...]:
    return (NameRule("model.layers.{}.self_attn.q_norm.weight", "layers.{}.attention.q_norm.weight"),
            NameRule("model.layers.{}.self_attn.k_norm.weight", "layers.{}.attention.k_norm.weight"))

# DCP top-level key families of a TorchTitan checkpoint besides the model's own (flat) keys:
# ``optimizer.state.<param>.{step,exp_avg,exp_avg_sq}``, ``optimizer.param_groups.<param>.<field>``,
# ``lr_scheduler.last_epoch``, ``train_state.{step,ntokens_seen}``, ``dataloader`` (CheckpointManager's).
STATE_FAMILIES = ("optimizer", "lr_scheduler", "train_state", "dataloader")


@dataclass(frozen=True)
class NameRule:
    """One parameter: its HF and TorchTitan names ("{}" = layer) and whether its rows are RoPE-permuted."""

    hf: str
    titan: str
    rope: bool = False


# In TorchTitan's state_dict order (model.state_dict() of Llama3Model with its fused-QKV hooks).
GLOBAL_HEAD = (NameRule(EMBED, "tok_embeddings.weight"),)
LAYER_RULES = (
    NameRule("model.layers.{}.self_attn.q_proj.weight", "layers.{}.attention.qkv_linear.wq.weight", rope=True),
    NameRule("model.layers.{}.self_attn.k_proj.weight", "layers.{}.attention.qkv_linear.wk.weight", rope=True),
    NameRule("model.layers.{}.self_attn.v_proj.weight", "layers.{}.attention.qkv_linear.wv.weight"),
    NameRule("model.layers.{}.self_attn.o_proj.weight", "layers.{}.attention.wo.weight"),
    NameRule("model.layers.{}.mlp.gate_proj.weight", "layers.{}.feed_forward.w1.weight"),
    NameRule("model.layers.{}.mlp.down_proj.weight", "layers.{}.feed_forward.w2.weight"),
    NameRule("model.layers.{}.mlp.up_proj.weight", "layers.{}.feed_forward.w3.weight"),
    NameRule("model.layers.{}.input_layernorm.weight", "layers.{}.attention_norm.weight"),
    NameRule("model.layers.{}.post_attention_layernorm.weight", "layers.{}.ffn_norm.weight"),
)
GLOBAL_TAIL = (NameRule("model.norm.weight", "norm.weight"), NameRule(LM_HEAD, "lm_head.weight"))
# The families TorchTitan has a model for (by HF model_type), and that model.
TITAN_MODELS = {"llama": TitanModel("llama3", complex_rope=True),
                "qwen3": TitanModel("qwen3", complex_rope=False, extra_layer_rules=_qk_norms()),
                "qwen3_moe": TitanModel("qwen3", complex_rope=False, extra_layer_rules=_qk_norms()),
                "deepseek_v3": TitanModel("deepseek_v3", complex_rope=True, module="ckptconv.titan.deepseek_v3"),
                "gpt_oss": TitanModel("gpt_oss", complex_rope=False, module="ckptconv.titan.gpt_oss")}
# Why a family with experts has no TorchTitan model (its MoE models upstream: qwen3, deepseek_v3, gpt_oss, ...).
NO_TITAN_MOE = {"mixtral": ": there is no Mixtral model upstream (no TorchTitan module would load or train its "
                           "block_sparse_moe experts)"}


def titan_model(spec: ModelSpec) -> TitanModel:
    """The TorchTitan model of ``spec``'s family; a family TorchTitan has no model for is refused, naming those it has."""
    model = TITAN_MODELS.get(spec.family.model_type)
    if model is None:
        has = ", ".join(f"{t} ({m.name})" for t, m in TITAN_MODELS.items())
        why = NO_TITAN_MOE.get(spec.family.model_type, "")
        raise ConversionError(f"TorchTitan {TITAN_VERSION} has no model for {spec.family.name} (model_type "
                              f"{spec.family.model_type!r}){why}; the families it has: {has}")
    return model


def layer_rules(model: TitanModel) -> tuple[NameRule, ...]:
    """The layer rules of ``model`` in its state_dict order (q/k norms after ``wo``), RoPE rows as its RoPE needs."""
    rules = (*LAYER_RULES[:4], *model.extra_layer_rules, *LAYER_RULES[4:])
    return rules if model.complex_rope else tuple(NameRule(r.hf, r.titan) for r in rules)


# HF tensors TorchTitan does not keep (it recomputes its RoPE cache).
DROPPED_HF = ("model.layers.{}.self_attn.rotary_emb.inv_freq",)
# The parameter TorchTitan trains (and keys optimizer state by); its saved model state splits it
# into wq/wk/wv. Rows: for each KV group g, its q heads, then k head g, then v head g.
FUSED_QKV = "layers.{}.attention.qkv_linear.wqkv.weight"

_LAYER = re.compile(r"(?<=layers\.)(\d+)(?=\.)")


def _pattern(name: str) -> tuple[str, int | None]:
    m = _LAYER.search(name)
    return (name, None) if m is None else (name[:m.start()] + "{}" + name[m.end():], int(m.group(1)))


@cache
def _by_hf() -> dict[str, NameRule]:
    return {r.hf: r for r in (*GLOBAL_HEAD, *LAYER_RULES, *_qk_norms(), *GLOBAL_TAIL)}


@cache
def _by_titan() -> dict[str, NameRule]:
    return {r.titan: r for r in (*GLOBAL_HEAD, *LAYER_RULES, *_qk_norms(), *GLOBAL_TAIL)}


def titan_name(hf_key: str) -> str:
    """TorchTitan's name of an HF parameter (KeyError for one TorchTitan does not keep, and for an expert or router:
    TorchTitan stacks those, see :func:`moe_params`)."""
    pattern, layer = _pattern(hf_key)
    rule = _by_hf()[pattern]
    return rule.titan if layer is None else rule.titan.format(layer)


def hf_name(titan_key: str) -> str:
    """The HF name of a TorchTitan model key (KeyError for an unknown one)."""
    pattern, layer = _pattern(titan_key)
    rule = _by_titan()[pattern]
    return rule.hf if layer is None else rule.hf.format(layer)


def is_rope_permuted(hf_key: str, model: TitanModel = TITAN_MODELS["llama"]) -> bool:
    """Whether the rows of this HF parameter (and of every per-parameter tensor of it) are permuted in ``model``."""
    return model.complex_rope and _by_hf()[_pattern(hf_key)[0]].rope


@cache
def rope_rows(head_dim: int) -> tuple[int, ...]:
    """Row order of one q/k head: TorchTitan's row ``i`` is HF's row ``rope_rows(head_dim)[i]``.

    HF keeps a head's rotated pairs as halves (``i`` with ``i + hd/2``); TorchTitan's complex RoPE
    as neighbours (``2i`` with ``2i+1``).
    """
    if head_dim % 2:
        raise ConversionError(f"config.json: head_dim {head_dim} is odd; RoPE needs an even head_dim")
    half = head_dim // 2
    return tuple(half * (i % 2) + i // 2 for i in range(head_dim))


def inverse_rows(perm: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes ``perm`` (HF's row ``i`` of a head is TorchTitan's ``inverse[i]``)."""
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return tuple(out)


@dataclass(frozen=True)
class TitanPiece:
    """Rows ``[start, stop)`` of an HF parameter, head by head in RoPE order when ``rope``."""

    hf_key: str
    start: int
    stop: int
    rope: bool = False
    zeros: bool = False  # zeros (``hf_key`` only names a tensor of the model): a buffer HF has no counterpart of
    slab: int = -1  # rows of slab ``slab`` of a stacked HF tensor (GPT-OSS's experts), ``transposed`` if so
    transposed: bool = False


@dataclass(frozen=True)
class TitanParam:
    """One TorchTitan tensor: its key, shape, and the HF ranges (along ``dim``) it is made of, in order.

    ``slabs`` > 0: stacked experts, one HF tensor per slab (slab ``e`` is expert ``e``'s HF matrix, same orientation).
    ``buffer``: a model buffer, not a parameter (no optimizer state), fp32 zeros.
    """

    key: str
    shape: tuple[int, ...]
    pieces: tuple[TitanPiece, ...]
    dim: int = 0
    slabs: int = 0
    buffer: bool = False


# TorchTitan 0.3.0's MoE block of a sparse layer (torchtitan/models/common/moe.py: MoE, GroupedExperts, its router)
MOE_BIAS = "layers.{}.moe.expert_bias_E"
MOE_W1 = "layers.{}.moe.routed_experts.inner_experts.w1_EFD"
MOE_W2 = "layers.{}.moe.routed_experts.inner_experts.w2_EDF"
MOE_W3 = "layers.{}.moe.routed_experts.inner_experts.w3_EFD"
MOE_ROUTER = "layers.{}.moe.router.gate.weight"
_FEED_FORWARD = "layers.{}.feed_forward."


def moe_params(spec: ModelSpec, layer: int) -> list[TitanParam]:
    """The MoE block of sparse ``layer`` in TorchTitan's state_dict order: ``expert_bias_E`` (fp32 zeros: the
    buffer of TorchTitan's bias balancing, which HF has no counterpart of), ``w1_EFD``/``w2_EDF``/``w3_EFD`` (each
    expert's HF gate/down/up stacked, HF orientation), the router."""
    moe = spec.family.moe
    assert moe is not None, f"moe_params of {spec.family.name}"
    prefix, e_, i, h = f"model.layers.{layer}.", spec.experts, spec.expert_intermediate, spec.hidden
    experts = [tuple(prefix + n for n in moe.names.of(e)) for e in range(e_)]
    router = prefix + moe.names.router

    def stacked(key: str, part: int, shape: tuple[int, int, int], dim: int) -> TitanParam:
        return TitanParam(key.format(layer), shape, tuple(TitanPiece(x[part], 0, i) for x in experts), dim, e_)

    return [TitanParam(MOE_BIAS.format(layer), (e_,), (TitanPiece(router, 0, e_, zeros=True),), buffer=True),
            stacked(MOE_W1, 0, (e_, i, h), 0), stacked(MOE_W2, 2, (e_, h, i), 1), stacked(MOE_W3, 1, (e_, i, h), 0),
            TitanParam(MOE_ROUTER.format(layer), (e_, h), (TitanPiece(router, 0, e_),))]


def moe_layers(spec: ModelSpec) -> list[int]:
    """The layers whose TorchTitan block is an MoE (with ``expert_bias_E``): the sparse ones, every GPT-OSS layer."""
    model = TITAN_MODELS.get(spec.family.model_type)
    every = model is not None and model.name == "gpt_oss"
    return [n for n in range(spec.layers) if every or spec.sparse(n)]


def titan_params(spec: ModelSpec) -> list[TitanParam]:
    """The model keys TorchTitan's model of the family (:func:`titan_model`) saves for ``spec``, in its
    state_dict order (a sparse layer's MoE block, :func:`moe_params`, in the slot of ``feed_forward``).

    A tied model saves both ``tok_embeddings.weight`` and ``lm_head.weight`` (one tensor under two
    names in TorchTitan; two copies in DCP), both from HF's embedding.
    """
    model = titan_model(spec)
    if model.module is not None:
        params: list[TitanParam] = importlib.import_module(model.module).titan_params(spec)
        return params
    shapes = hf_shapes(spec, with_inv_freq=False)
    rules: list[NameRule | TitanParam] = [*GLOBAL_HEAD]
    for n in range(spec.layers):
        for r in layer_rules(titan_model(spec)):
            if spec.sparse(n) and r.titan.startswith(_FEED_FORWARD):
                rules += moe_params(spec, n) if r.titan.endswith("w1.weight") else []
            else:
                rules.append(NameRule(r.hf.format(n), r.titan.format(n), r.rope))
    out = []
    for rule in [*rules, *GLOBAL_TAIL]:
        if isinstance(rule, TitanParam):
            out.append(rule)
            continue
        source = EMBED if rule.hf == LM_HEAD and spec.tied else rule.hf
        shape = shapes[source]
        out.append(TitanParam(rule.titan, shape, (TitanPiece(source, 0, shape[0], rule.rope),)))
    return out


def shared_copies(spec: ModelSpec) -> dict[str, str]:
    """HF tensors that TorchTitan keeps once, as another HF tensor (copy -> the HF key it copies: DeepSeek-V3's MTP
    embedding and head are the model's); written back from that one."""
    model = titan_model(spec)
    copies: dict[str, str] = {} if model.module is None else importlib.import_module(model.module).shared_copies(spec)
    return copies


def fused_qkv_param(spec: ModelSpec, layer: int, kind: str = "weight") -> TitanParam:
    """The fused ``wqkv`` parameter of ``layer`` (what TorchTitan's optimizer state is keyed by; ``kind`` "bias":
    GPT-OSS's fused bias): for each KV group, its q heads, its k head, its v head; q and k rows in RoPE order."""
    hd, group, rope = spec.head_dim, spec.group, titan_model(spec).complex_rope
    prefix = f"model.layers.{layer}.self_attn."
    pieces = []
    for g in range(spec.kv_heads):
        pieces.append(TitanPiece(prefix + f"q_proj.{kind}", g * group * hd, (g + 1) * group * hd, rope=rope))
        pieces.append(TitanPiece(prefix + f"k_proj.{kind}", g * hd, (g + 1) * hd, rope=rope))
        pieces.append(TitanPiece(prefix + f"v_proj.{kind}", g * hd, (g + 1) * hd))
    rows = spec.q_rows + 2 * spec.kv_rows
    return TitanParam(FUSED_QKV.format(layer).replace(".weight", f".{kind}"),
                      (rows, spec.hidden) if kind == "weight" else (rows,), tuple(pieces))


def family(key: str) -> str:
    """``"model"`` for a model key, else the state family (``"optimizer"``, ...) its first part names."""
    head = key.split(".", 1)[0]
    return head if head in STATE_FAMILIES else "model"


# What TorchTitan 0.3.0's CheckpointManager writes besides the model (established by letting it save
# a full checkpoint of AdamW training; all of them are required when it loads a full checkpoint).
OPTIMIZER_STATE_FIELDS = ("step", "exp_avg", "exp_avg_sq")
PARAM_GROUP_FIELDS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
                      "capturable", "differentiable", "fused", "decoupled_weight_decay")
LR_SCHEDULER_KEYS = ("lr_scheduler.last_epoch",)
TRAIN_STATE_KEYS = ("train_state.step", "train_state.ntokens_seen")


_SPLIT_QKV = ("wq.weight", "wk.weight", "wv.weight", "wq.bias", "wk.bias", "wv.bias")


def trained_params(spec: ModelSpec) -> list[TitanParam]:
    """The parameters TorchTitan's optimizer state is keyed by, in its order: the model's, with q/k/v
    as the fused ``wqkv`` (:func:`fused_qkv_param`), no ``lm_head`` when tied (it is the embedding) and no
    buffer (``expert_bias_E``)."""
    out = []
    for param in titan_params(spec):
        if (spec.tied and param.key == "lm_head.weight") or param.buffer:
            continue
        m = _LAYER.search(param.key)
        if m is not None and ".qkv_linear." in param.key and param.key.endswith(_SPLIT_QKV):
            if param.key.endswith(_SPLIT_QKV[::3]):  # wq.weight, wq.bias: the fused parameter in wq's slot
                out.append(fused_qkv_param(spec, int(m.group(1)), param.key.rsplit(".", 1)[1]))
            continue
        out.append(param)
    return out


def optimizer_params(spec: ModelSpec) -> list[str]:
    """The names of :func:`trained_params`."""
    return [p.key for p in trained_params(spec)]


def optimizer_key(param: str, component: str) -> str:
    """TorchTitan's DCP key of an optimizer tensor (``exp_avg``, ...) of a trained parameter."""
    return f"optimizer.state.{param}.{component}"


def param_group_key(param: str, field: str) -> str:
    """TorchTitan's DCP key of a param-group field (``lr``, ...), saved once per trained parameter."""
    return f"optimizer.param_groups.{param}.{field}"


def is_known_state_key(key: str, trained: Collection[str]) -> bool:
    """Whether a non-model key is one TorchTitan's CheckpointManager writes for a model whose trained
    parameters are ``trained`` (:func:`optimizer_params`)."""
    fam = family(key)
    if fam == "dataloader":
        return True  # the data loader's own state, whatever its loader saves
    if fam in ("lr_scheduler", "train_state"):
        return key in LR_SCHEDULER_KEYS + TRAIN_STATE_KEYS
    for kind, fields in (("state", OPTIMIZER_STATE_FIELDS), ("param_groups", PARAM_GROUP_FIELDS)):
        prefix = f"optimizer.{kind}."
        if key.startswith(prefix):
            param, _, name = key[len(prefix):].rpartition(".")
            return name in fields and param in trained
    return False


def planner_path(key: str) -> tuple[str, ...]:
    """Where a flat DCP key sits in the nested state dict TorchTitan saves (DCP's ``planner_data``):
    model keys at top level, a family's keys one level down (``("optimizer", "state.<param>.exp_avg")``)."""
    fam = family(key)
    if fam == "model" or "." not in key:
        return (key,)
    return (fam, key.split(".", 1)[1])
