"""``ckptconv verify HF DCP``: a TorchTitan DCP computes what the HF model computes, layer by layer, on the DCP's
tensors in TorchTitan's layout (its key names, complex RoPE on interleaved pairs for llama3, cos/sin RoPE for qwen3),
read by :mod:`ckptconv.io.dcp` without TorchTitan or torch's DCP package.

Each sampled layer runs twice on the same random input: the HF dense layer (:func:`ckptconv.core.reference.
dense_layer`) and TorchTitan's attention and feed-forward from the DCP's tensors; attention, mlp and output are
compared, and a mismatch is blamed on the heads whose outputs differ or on the norm weights. The embedding and the
output projection are checked on random token ids and hidden states.

llama3 and qwen3, dense or with experts (Qwen3-MoE): a sparse layer's ``moe`` block (router ``[E, H]``, experts
stacked ``w1_EFD``/``w3_EFD`` ``[E, I, H]`` and ``w2_EDF`` ``[E, H, I]``, HF orientation) routes and runs as the HF
block does (:func:`ckptconv.core.reference.sparse_mlp`), each expert is also run alone against the HF experts so a
corrupted or misplaced one is named (:func:`ckptconv.commands.verify_moe.expert_notes`), and a nonzero
``expert_bias_E`` (TorchTitan routes with it, HF has none) fails the layer. A fused ``wqkv`` (TorchTitan's
``FusedQKVLinear`` parameter, saved without its split hook) is split as that module splits it: for each KV group,
its q heads, its k head, its v head. DeepSeek-V3 and GPT-OSS are refused with a pointer to ``ckptconv diff``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckptconv.commands.verify_checks import (
    Check,
    as_json,
    close,
    compare,
    default_tol,
    hf_layer,
    problem,
    read_whole,
    sample_layers,
)
from ckptconv.commands.verify_moe import dense_sparse_mlp, expert_notes, hf_experts
from ckptconv.core.mapping import EMBED, FINAL_NORM, LM_HEAD
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.reference import (
    apply_rope,
    attention_heads,
    causal_attention,
    dense_layer,
    layer_attention_extras,
    mlp,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    sparse_mlp,
)
from ckptconv.engine.progress import byte_progress
from ckptconv.errors import ConversionError
from ckptconv.io.dcp import DcpCheckpoint
from ckptconv.io.hf import HfCheckpoint
from ckptconv.titan.names import MOE_BIAS, MOE_ROUTER, MOE_W1, MOE_W2, MOE_W3, titan_model


def verify_dcp(hf_dir: Path, dcp_dir: str | Path, *, layers: int | str, tol: float | None, seed: int,
               config: str | Path | None, check: bool, progress: bool) -> dict[str, Any]:
    """What :func:`ckptconv.commands.verify.verify` returns, for a DCP directory or TorchTitan root."""
    from ckptconv.sources.nxd import model_spec_of

    ckpt = DcpCheckpoint(dcp_dir, check=check)  # a key the model needs and the DCP lacks: named when read
    try:
        spec = model_spec_of(ckpt.root, ckpt.metadata, config, missing="a TorchTitan checkpoint records no HF config; "
                             "pass --config PATH/config.json (the model's HF config)")
    except BaseException:
        ckpt.close()
        raise
    notes = [f"reading {ckpt.root} ({ckpt.found_as})"]
    generator = torch.Generator().manual_seed(seed)
    results: dict[str, Any] = {"layers": {}, "notes": notes}
    problems: list[str] = []
    with ckpt, HfCheckpoint(hf_dir, config=config) as hf:
        if hf.spec != spec:
            raise ConversionError(f"{hf_dir} and {dcp_dir} describe different models: {hf.spec} vs {spec}")
        model = titan_model(spec)
        if model.module is not None:
            raise ConversionError(f"{dcp_dir}: verify checks TorchTitan's llama3 and qwen3 (dense or MoE), not its "
                                  f"{model.name}; compare this one with ckptconv diff HF DCP")
        complex_rope = model.complex_rope
        tol = default_tol(hf, ckpt) if tol is None else tol
        sampled = sample_layers(spec.layers, layers)
        with byte_progress(f"verify {Path(dcp_dir).name}", len(sampled), quiet=not progress, of="layers") as advance:
            for layer in sampled:
                x = torch.randn(2, 16, spec.hidden, generator=generator)
                checks = _check_layer(x, spec, layer, hf_layer(hf, layer), _titan_layer(ckpt, spec, layer), complex_rope,
                                      tol)
                results["layers"][layer] = {c.name: as_json(c) for c in checks}
                problems += [problem(f"layer {layer} {c.name}", c, tol) for c in checks if not c.ok(tol)]
                advance(1)
        for c in _check_vocab(hf, ckpt, spec, generator):
            results[c.name] = as_json(c)
            if not c.ok(tol):
                problems.append(problem(c.name, c, tol))
        ckpt.finish_checks()
    results.update(ok=not problems, problems=problems, tol=tol, layout={"format": "dcp", "root": str(ckpt.root)})
    return results


def _titan_layer(ckpt: DcpCheckpoint, spec: ModelSpec, layer: int) -> dict[str, torch.Tensor]:
    """One layer's model tensors by their names without ``layers.N.``, a fused ``wqkv`` split into wq/wk/wv."""
    prefix = f"layers.{layer}."
    w = {k[len(prefix):]: read_whole(ckpt, k) for k, e in ckpt.entries.items() if k.startswith(prefix) and e.is_tensor}
    for kind in ("weight", "bias"):
        fused = w.pop(f"attention.qkv_linear.wqkv.{kind}", None)
        if fused is not None:
            w.update(_split_wqkv(fused, spec, f"{ckpt.root}: {prefix}attention.qkv_linear.wqkv.{kind}", kind))
    return w


def _split_wqkv(fused: torch.Tensor, spec: ModelSpec, where: str, kind: str) -> dict[str, torch.Tensor]:
    """wq/wk/wv of TorchTitan's fused ``wqkv``: rows grouped by KV head, each group its q heads, its k head, its v
    head (``FusedQKVLinear``'s split on save)."""
    rows, hd, group = spec.q_rows + 2 * spec.kv_rows, spec.head_dim, spec.group
    if fused.shape[0] != rows:
        raise ConversionError(f"{where}: {fused.shape[0]} rows, expected {rows} (q {spec.q_rows} + k and v "
                              f"{spec.kv_rows} each)")
    grouped = fused.reshape(spec.kv_heads, group + 2, hd, *fused.shape[1:])
    parts = {"wq": grouped[:, :group], "wk": grouped[:, group], "wv": grouped[:, group + 1]}
    return {f"attention.qkv_linear.{p}.{kind}": t.reshape(-1, *fused.shape[1:]) for p, t in parts.items()}


def _complex_rope(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """TorchTitan's llama3 RoPE: each adjacent pair of a head's dims is one complex number, turned by position."""
    angles = torch.arange(x.shape[-2], dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def _titan_attention(h: torch.Tensor, w: dict[str, torch.Tensor], spec: ModelSpec, complex_rope: bool,
                     eps: float) -> torch.Tensor:
    """Attention heads (batch, seq, heads * head_dim) from TorchTitan's wq/wk/wv (and q/k norms), before wo."""
    batch, seq, _ = h.shape
    hd = spec.head_dim
    q, k, v = (torch.nn.functional.linear(h, w[f"attention.qkv_linear.{p}.weight"]).view(batch, seq, -1, hd).transpose(1, 2)
               for p in ("wq", "wk", "wv"))
    if "attention.q_norm.weight" in w:
        q, k = rms_norm(q, w["attention.q_norm.weight"], eps), rms_norm(k, w["attention.k_norm.weight"], eps)
    inv_freq = rope_inv_freq(spec.config, hd)
    if complex_rope:
        q, k = _complex_rope(q, inv_freq), _complex_rope(k, inv_freq)
    else:
        cos, sin = rope_cos_sin(inv_freq, seq)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = q.shape[1] // k.shape[1]
    out = causal_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), window=spec.window)
    return out.transpose(1, 2).reshape(batch, seq, -1)


def _check_layer(x: torch.Tensor, spec: ModelSpec, layer: int, hf_w: dict[str, torch.Tensor],
                 w: dict[str, torch.Tensor], complex_rope: bool, tol: float) -> list[Check]:
    eps = float(spec.config.get("rms_norm_eps", 1e-6))
    sparse = spec.sparse(layer)
    dense = dense_layer(x, hf_w, spec.config, spec.head_dim, window=spec.window,
                        mlp_of=dense_sparse_mlp(spec, hf_w) if sparse else None)
    heads = _titan_attention(rms_norm(x, w["attention_norm.weight"], eps), w, spec, complex_rope, eps)
    attention = heads @ w["attention.wo.weight"].t()
    x1 = x + attention
    h2 = rms_norm(x1, w["ffn_norm.weight"], eps)
    extra: list[Check] = []
    if sparse:
        m, mlp_detail, extra = _titan_moe(h2, spec, w, hf_w, tol)
    else:
        m, mlp_detail = mlp(h2, w["feed_forward.w1.weight"], w["feed_forward.w3.weight"], w["feed_forward.w2.weight"]), ""
    checks = [compare("attention", attention, dense["attention"]), compare("mlp", m, dense["mlp"]),
              compare("output", x1 + m, dense["output"]), *extra]
    checks[1].detail = mlp_detail
    # blame: the heads whose outputs differ (from the HF norm's input, so a norm fault is not a head fault)
    hf_heads = _titan_attention(rms_norm(x, hf_w["input_layernorm.weight"], eps), w, spec, complex_rope, eps)
    cos, sin = rope_cos_sin(rope_inv_freq(spec.config, spec.head_dim), x.shape[1])
    expected = attention_heads(rms_norm(x, hf_w["input_layernorm.weight"], eps), hf_w["self_attn.q_proj.weight"],
                               hf_w["self_attn.k_proj.weight"], hf_w["self_attn.v_proj.weight"], spec.head_dim, cos, sin,
                               window=spec.window, **layer_attention_extras(hf_w, eps))
    per_head = (hf_heads - expected).abs().view(*x.shape[:2], spec.heads, spec.head_dim).amax(dim=(0, 1, 3))
    scale = expected.abs().max().clamp_min(1e-12)
    bad_heads = [h for h in range(spec.heads) if per_head[h] > tol * scale]
    bad_norms = [name for name, hf_name in (("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"))
                 if not torch.allclose(w[f"{name}.weight"], hf_w[f"{hf_name}.weight"], rtol=tol, atol=0)]
    details = [f"Q/K/V heads {', '.join(map(str, bad_heads))} differ" if bad_heads else "",
               f"norm weights {', '.join(bad_norms)} differ" if bad_norms else ""]
    checks[0].detail = "; ".join(d for d in details if d)
    return checks


def _titan_moe(h2: torch.Tensor, spec: ModelSpec, w: dict[str, torch.Tensor], hf_w: dict[str, torch.Tensor],
               tol: float) -> tuple[torch.Tensor, str, list[Check]]:
    """A sparse layer's MoE block from TorchTitan's tensors, routed as the HF block routes: its output, what differs
    (router, experts by name), and a failing ``expert_bias`` check where TorchTitan's routing bias is not zero."""
    moe = spec.family.moe
    assert moe is not None
    router = w[_in_layer(MOE_ROUTER)]
    stacks = [w[_in_layer(key)] for key in (MOE_W1, MOE_W3, MOE_W2)]  # gate, up, down
    experts = {e: (stacks[0][e], stacks[1][e], stacks[2][e]) for e in range(spec.experts)}
    out = sparse_mlp(h2, router, experts, spec.top_k, normalize=moe.norm_topk(spec.config), cast_back=moe.cast_topk)
    flat = h2.reshape(-1, spec.hidden)
    expected = {e: mlp(flat, *expert) for e, expert in hf_experts(spec, hf_w).items()}
    notes = [] if close(router, hf_w[moe.names.router], tol) else ["router differs"]
    notes += expert_notes(flat, experts, expected, lambda a, b: close(a, b, tol))
    bias = w.get(_in_layer(MOE_BIAS))
    extra = []
    if bias is not None and bool(bias.any()):
        largest = bias.abs().max().item()
        extra.append(Check("expert_bias", largest, float("inf"), detail="expert_bias_E is not zero: TorchTitan adds "
                           "it to the router's scores to choose experts, HF has no such bias"))
    return out, "; ".join(notes), extra


def _in_layer(key: str) -> str:
    """A layer key's name within its layer (``layers.{}.moe.router.gate.weight`` -> ``moe.router.gate.weight``)."""
    return key.split("{}.", 1)[1]


def _check_vocab(hf: HfCheckpoint, ckpt: DcpCheckpoint, spec: ModelSpec, generator: torch.Generator) -> list[Check]:
    eps = float(spec.config.get("rms_norm_eps", 1e-6))
    embed, titan_embed = read_whole(hf, EMBED), read_whole(ckpt, "tok_embeddings.weight")
    ids = torch.randint(0, spec.vocab, (2, 16), generator=generator)
    checks = [compare("embedding", titan_embed[ids], embed[ids])]
    x = torch.randn(2, 16, spec.hidden, generator=generator)
    head = embed if spec.tied else read_whole(hf, LM_HEAD)
    expected = rms_norm(x, read_whole(hf, FINAL_NORM), eps) @ head.t()
    titan_head = read_whole(ckpt, "lm_head.weight") if "lm_head.weight" in ckpt.entries else titan_embed
    checks.append(compare("lm_head", rms_norm(x, read_whole(ckpt, "norm.weight"), eps) @ titan_head.t(), expected))
    return checks
