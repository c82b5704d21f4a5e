"""GPT-OSS through TorchTitan (pinned 0.3.0): its ``gpt_oss`` model's names, and the model its config builds.

TorchTitan's ``GptOssModel`` saves (checked against its live ``state_dict()`` in the TorchTitan lane) per layer
``attention.sinks`` first (a parameter of the attention module itself), the q/k/v weights then their biases (its fused
``wqkv`` split on save), ``wo``, the two norms, then the MoE block: the fp32 buffer ``moe.expert_bias_E`` (its
auxiliary-loss-free balancing; zeros from HF), the experts ``mlp1_weight_EGD`` ``[E, 2I, H]`` and ``mlp2_weight_EDF``
``[E, H, I]`` (``[out, in]``: each expert's HF ``gate_up_proj[e]`` ``[H, 2I]`` and ``down_proj[e]`` ``[I, H]``
**transposed**; the gate/up interleave kept, as its ``swiglu`` reads ``[..., ::2]`` and ``[..., 1::2]`` too), their
biases as HF stores them, and the router ``moe.router.gate.{weight,bias}``. Its 0.3.0 HF adapter maps the experts
under the quantized ``*_blocks`` names (an HF export from it drops them); this table is the live model's.

    >>> LAYER[0], LAYER[-1]
    (('self_attn.sinks', 'attention.sinks', ''), ('mlp.router.bias', 'moe.router.gate.bias', ''))
"""

from __future__ import annotations

from typing import Any

from ckptconv.core.families.gpt_oss import ALPHA, experts_of, layer_window
from ckptconv.core.mapping import EMBED, LM_HEAD, hf_shapes
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.reference import rope_parameters
from ckptconv.errors import ConversionError
from ckptconv.titan.names import TitanParam, TitanPiece

MODEL = "gpt_oss"
# what torchtitan_config.py imports from torchtitan.models.gpt_oss (ckptconv.titan.config_file asks)
MODEL_CLS = "GptOssModel"
BUILDERS = "_build_gptoss_layers, _make_gptoss_attn_config"
ZEROS, TRANSPOSED = "zeros", "transposed"  # a buffer HF has no counterpart of; stacked [out, in] of HF's [in, out]
_EXPERTS = "moe.routed_experts.inner_experts."
# (HF name under model.layers.N., TorchTitan's under layers.N., how), in TorchTitan's state_dict order
LAYER = (
    ("self_attn.sinks", "attention.sinks", ""),
    *((f"self_attn.{p}_proj.{kind}", f"attention.qkv_linear.w{p}.{kind}", "") for kind in ("weight", "bias")
      for p in "qkv"),
    ("self_attn.o_proj.weight", "attention.wo.weight", ""),
    ("self_attn.o_proj.bias", "attention.wo.bias", ""),
    ("input_layernorm.weight", "attention_norm.weight", ""),
    ("post_attention_layernorm.weight", "ffn_norm.weight", ""),
    ("mlp.router.bias", "moe.expert_bias_E", ZEROS),
    ("mlp.experts.gate_up_proj", _EXPERTS + "mlp1_weight_EGD", TRANSPOSED),
    ("mlp.experts.gate_up_proj_bias", _EXPERTS + "mlp1_bias_EG", ""),
    ("mlp.experts.down_proj", _EXPERTS + "mlp2_weight_EDF", TRANSPOSED),
    ("mlp.experts.down_proj_bias", _EXPERTS + "mlp2_bias_ED", ""),
    ("mlp.router.weight", "moe.router.gate.weight", ""),
    ("mlp.router.bias", "moe.router.gate.bias", ""),
)
# The parameters TorchTitan trains as one (its FusedQKVLinear): wqkv's rows are q, k, v (no head grouping)
FUSED = {"attention.qkv_linear.wqkv.weight": "weight", "attention.qkv_linear.wqkv.bias": "bias"}


def titan_params(spec: ModelSpec) -> list[TitanParam]:
    """TorchTitan's gpt_oss keys (:data:`LAYER`), in its state_dict order: each HF tensor whole, the experts' weights
    stacked slab by slab transposed (``[E, out, in]`` of HF's ``[E, in, out]``), ``expert_bias_E`` fp32 zeros."""
    shapes = hf_shapes(spec, with_inv_freq=False)

    def whole(hf: str, titan: str) -> TitanParam:
        return TitanParam(titan, shapes[hf], (TitanPiece(hf, 0, shapes[hf][0]),))

    out = [whole(EMBED, "tok_embeddings.weight")]
    for n in range(spec.layers):
        for hf_rel, titan_rel, how in LAYER:
            hf, titan = f"model.layers.{n}.{hf_rel}", f"layers.{n}.{titan_rel}"
            e = shapes[hf][0]
            if how == ZEROS:
                out.append(TitanParam(titan, (e,), (TitanPiece(hf, 0, e, zeros=True),), buffer=True))
            elif how == TRANSPOSED:
                _, rows, cols = shapes[hf]
                pieces = tuple(TitanPiece(hf, 0, cols, slab=k, transposed=True) for k in range(e))
                out.append(TitanParam(titan, (e, cols, rows), pieces, slabs=e))
            else:
                out.append(whole(hf, titan))
    return [*out, whole("model.norm.weight", "norm.weight"), whole(EMBED if spec.tied else LM_HEAD, "lm_head.weight")]


def shared_copies(spec: ModelSpec) -> dict[str, str]:
    """No HF tensor of GPT-OSS is kept as another's copy."""
    return {}


def loss(spec: ModelSpec) -> None:
    """TorchTitan's default cross-entropy (no loss of its own)."""
    return None


def check_titan(spec: ModelSpec) -> None:
    """What TorchTitan's gpt_oss cannot compute, refused naming the key: another SwiGLU alpha (its ``swiglu``
    hard-codes 1.702), sliding layers of different windows (one mask for all), a YaRN attention factor other than
    ``0.1 ln(factor) + 1``."""
    c = spec.config
    if float(c.get("swiglu_alpha", ALPHA)) != ALPHA:
        raise ConversionError(f"config.json: swiglu_alpha is {c['swiglu_alpha']!r}; TorchTitan {MODEL}'s swiglu "
                              f"computes alpha {ALPHA} only")
    windows = {w for n in range(spec.layers) if (w := layer_window(c, n)) is not None}
    if len(windows) > 1:
        raise ConversionError(f"config.json: sliding windows {sorted(windows)}; TorchTitan {MODEL} masks every "
                              "sliding layer with one window")
    params = rope_parameters(c)
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            raise ConversionError(f"config.json: rope_parameters.{key} is {params[key]!r}; TorchTitan {MODEL} scales "
                                  "attention by YaRN's 0.1 ln(factor) + 1 only")


def titan_rope(spec: ModelSpec) -> dict[str, Any]:
    """TorchTitan's ``CosSinRoPE.Config`` fields of a GPT-OSS config (YaRN or none)."""
    params = rope_parameters(spec.config)
    kind = params["rope_type"]
    rope: dict[str, Any] = {"theta": float(params["rope_theta"])}
    if kind == "default":
        return {**rope, "scaling": "none"}
    if kind != "yarn":
        raise ConversionError(f"config.json: rope_type {kind!r}: TorchTitan {MODEL} computes yarn or none")
    return {**rope, "scaling": "yarn", "rope_factor": float(params["factor"]),
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "truncate": bool(params.get("truncate", True)),
            "original_seq_len": int(params["original_max_position_embeddings"])}


def model_lines(spec: ModelSpec) -> list[str]:
    """``model_config()`` of ``torchtitan_config.py``: TorchTitan's own GPT-OSS builders with the HF config's
    heads, head_dim and window per layer (its builder hard-codes 64 heads and a window of 128 on even layers)."""
    check_titan(spec)
    c, (experts, top_k) = spec.config, experts_of(spec)
    eps = float(c.get("rms_norm_eps", 1e-5))
    windows = tuple(layer_window(c, n) for n in range(spec.layers))
    rope_args = ", ".join(f"{k}={v!r}" for k, v in titan_rope(spec).items())
    max_pos = int(c.get("max_position_embeddings") or 4096)
    return [
        "def model_config() -> GptOssModel.Config:",
        '    """TorchTitan\'s gpt_oss for the HF config this DCP was written from (hf/config.json)."""',
        f"    dim, vocab, eps = {spec.hidden}, {spec.vocab}, {eps!r}",
        f"    rope = CosSinRoPE.Config(dim={spec.head_dim}, **_rope_length(CosSinRoPE, max(SEQ_LEN, {max_pos})), {rope_args})",
        f"    layers = _build_gptoss_layers(dim=dim, n_layers={spec.layers}, hidden_dim={spec.intermediate}, "
        f"num_experts={experts}, top_k={top_k}, load_balance_coeff=1e-3, attn_backend=ATTN_BACKEND, fuse_qkv=True, "
        "moe_comm_backend=MOE_COMM_BACKEND, rope=rope)",
        f"    windows = {windows!r}  # layer_types: sliding_window on sliding_attention layers, None on full ones",
        "    for n, layer in enumerate(layers):  # the HF config's heads and windows (the builder's are the 120B's)",
        "        layer.attention = _make_gptoss_attn_config(dim=dim, layer_id=n, attn_backend=ATTN_BACKEND, "
        f"n_heads={spec.heads}, n_kv_heads={spec.kv_heads}, head_dim={spec.head_dim}, "
        "sliding_window_size=windows[n], fuse_qkv=True, rope=rope)",
        f"        layer.moe.routed_experts.inner_experts.swiglu_limit = {float(c.get('swiglu_limit', 7.0))!r}",
        "        layer.attention_norm.eps = layer.ffn_norm.eps = eps",
        "    # expert_bias_E (zeros in the DCP) is TorchTitan's auxiliary-loss-free load balancing (load_balance_coeff",
        f"    # 1e-3): it replaces the source's router aux loss (router_aux_loss_coef {c.get('router_aux_loss_coef')!r})",
        "    return GptOssModel.Config(",
        "        dim=dim, vocab_size=vocab, layers=layers, enable_weight_tying=" + repr(spec.tied) + ",",
        "        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_INIT),",
        "        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM_INIT),",
        "        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_INIT),",
        "    )",
    ]
