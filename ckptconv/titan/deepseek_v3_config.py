"""``model_config()`` of ``OUT/torchtitan_config.py`` for DeepSeek-V3: TorchTitan's ``deepseek_v3`` built with its own
layer builders (``_build_dsv3_layers``, ``_build_mtp_layers``, what its presets use) from the HF config.

The MLA dims, the dense layers (``first_k_dense_replace``), the MoE block (sigmoid scores, ``n_group`` /
``topk_group``, ``routed_scaling_factor``, ``norm_topk_prob``, shared experts, the load-balancing bias), the MTP layers
the DCP carries, YaRN RoPE (its factor, betas, original length; HF's ``mscale_all_dim`` is TorchTitan's attention
``mscale``, folded into the softmax scale as both do) and the norm eps. A YaRN whose cos/sin HF scales (``mscale``
!= ``mscale_all_dim``: TorchTitan's RoPE is a pure rotation) is refused, as is any other RoPE scaling.

    >>> titan_yarn({"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
    ...             "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}, "rope_theta": 1e4})
    ({'theta': 10000.0, 'scaling': 'yarn', 'rope_factor': 40.0, 'beta_fast': 32.0, 'beta_slow': 1.0, 'original_seq_len': 4096, 'truncate': True}, 1.0)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptconv.core.families.deepseek_v3 import dim, q_lora
from ckptconv.errors import ConversionError

if TYPE_CHECKING:
    from ckptconv.core.model_spec import ModelSpec

MODEL_CLS = "DeepSeekV3Model"
BUILDERS = "_build_dsv3_layers, _build_mtp_layers, MTPLoss"  # what the header imports from TorchTitan's module


def loss(spec: ModelSpec) -> str | None:
    """The loss of a model with MTP layers (its forward returns the main logits and one per MTP layer): TorchTitan's
    ``MTPLoss`` (its default weight 0.3 on the MTP layers' mean loss); None: the default loss."""
    return f"MTPLoss.Config(global_vocab_size={spec.vocab})" if spec.mtp_layers else None


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    given = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else None
    return dict(given or config.get("rope_scaling") or {})


def titan_yarn(config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """TorchTitan's RoPE config fields and attention ``mscale`` for an HF DeepSeek-V3 config."""
    params = _rope_params(config)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return {"theta": theta, "scaling": "none"}, 0.0
    if kind != "yarn":
        raise ConversionError(f"config.json: rope scaling {kind!r}: TorchTitan's deepseek_v3 computes yarn or none, so "
                              "the model would load and train with another RoPE")
    original = int(params.get("original_max_position_embeddings") or 4096)
    factor = float(params.get("factor") or config.get("max_position_embeddings", original) / original)
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    given = params.get("attention_factor")
    scaled = (given is not None and float(given) != 1.0) or (given is None and factor > 1 and (
        not (mscale and mscale_all) or float(mscale) != float(mscale_all)))
    if scaled:
        raise ConversionError(f"config.json: yarn mscale {mscale!r} / mscale_all_dim {mscale_all!r} (attention_factor "
                              f"{given!r}) scales HF's cos/sin; TorchTitan's RoPE is a pure rotation (it folds only "
                              "mscale_all_dim into the softmax scale), so the model would compute other logits")
    rope = {"theta": theta, "scaling": "yarn", "rope_factor": factor,
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "original_seq_len": original, "truncate": bool(params.get("truncate", True))}
    return rope, float(mscale_all or 0.0)


def model_lines(spec: ModelSpec) -> list[str]:
    """``model_config()`` for ``spec`` (the header imports :data:`MODEL_CLS` and :data:`BUILDERS`)."""
    c = spec.config
    moe = spec.family.moe
    assert moe is not None
    rope, mscale = titan_yarn(c)
    groups = c.get("n_group") or 1
    if spec.mtp_layers and not spec.sparse(spec.layers - 1):
        raise ConversionError("config.json: the last decoder layer is dense, the MTP layers sparse; TorchTitan's "
                              "deepseek_v3 copies the last layer's block into its MTP layers")
    eps = float(c.get("rms_norm_eps", 1e-6))
    max_pos = int(c.get("max_position_embeddings") or 4096)
    rope_args = ", ".join(f"{k}={v!r}" for k, v in rope.items())
    return [
        f"def model_config() -> {MODEL_CLS}.Config:",
        '    """TorchTitan\'s deepseek_v3 for the HF config this DCP was written from (hf/config.json)."""',
        f"    dim, vocab, eps = {spec.hidden}, {spec.vocab}, {eps!r}",
        f"    rope = ComplexRoPE.Config(dim={spec.head_dim}, **_rope_length(ComplexRoPE, max(SEQ_LEN, {max_pos})), {rope_args})",
        f"    layers = _build_dsv3_layers(n_layers={spec.layers}, n_dense_layers={sum(not spec.sparse(n) for n in range(spec.layers))}, "
        f"dim=dim, n_heads={spec.heads},",
        f"        q_lora_rank={q_lora(c)}, kv_lora_rank={dim(c, 'kv_lora_rank')}, "
        f"qk_nope_head_dim={dim(c, 'qk_nope_head_dim')}, qk_rope_head_dim={spec.head_dim}, "
        f"v_head_dim={dim(c, 'v_head_dim')}, mscale={mscale!r},",
        f"        dense_hidden_dim={spec.intermediate}, moe_hidden_dim={spec.expert_intermediate}, "
        f"num_experts={spec.experts}, num_shared_experts={dim(c, 'n_shared_experts')},",
        f"        router_top_k={spec.top_k}, router_score_func='sigmoid', router_num_expert_groups={groups!r}, "
        f"router_num_limited_groups={c.get('topk_group') or 1!r},",
        f"        router_route_scale={float(c.get('routed_scaling_factor', 1.0))!r}, "
        f"router_route_norm={moe.norm_topk(c)!r},",
        "        attn_backend=ATTN_BACKEND, moe_comm_backend=MOE_COMM_BACKEND, non_blocking_capacity_factor=None, "
        "rope=rope)",
        f"    mtp = _build_mtp_layers(layers[-1], dim=dim, num_mtp_layers={spec.mtp_layers})  # "
        "the MTP layers the DCP carries",
        "    for layer in [*layers, *mtp]:  # the HF config's norm eps (the builders' default may differ)",
        "        for name in ('attention_norm', 'ffn_norm', 'enorm', 'hnorm', 'mtp_norm'):",
        "            if getattr(layer, name, None) is not None:",
        "                getattr(layer, name).eps = eps",
        "        layer.attention.q_norm.eps = layer.attention.kv_norm.eps = eps",
        "    # moe.expert_bias_E holds the HF router's e_score_correction_bias; TorchTitan keeps training it (its",
        "    # auxiliary-loss-free load balancing, load_balance_coeff 1e-3)",
        f"    return {MODEL_CLS}.Config(",
        "        dim=dim, vocab_size=vocab, layers=layers, mtp_layers=mtp,",
        "        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_INIT),",
        "        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM_INIT),",
        "        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_INIT),",
        "    )",
    ]
