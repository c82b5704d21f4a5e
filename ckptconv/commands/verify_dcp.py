"""``ckptconv verify HF DCP``: a TorchTitan DCP computes what the HF model computes, layer by layer, on the DCP's
tensors in TorchTitan's layout (its key names, complex RoPE on interleaved pairs for llama3, cos/sin RoPE for qwen3),
read by :mod:`ckptconv.io.dcp` without TorchTitan or torch's DCP package.

Each sampled layer runs twice on the same random input: the HF dense layer (:func:`ckptconv.core.reference.
dense_layer`) and TorchTitan's attention and feed-forward from the DCP's tensors; attention, mlp and output are
compared, and a mismatch is blamed on the heads whose outputs differ or on the norm weights. The embedding and the
output projection are checked on random token ids and hidden states. Dense llama3 / qwen3 models; a fused ``wqkv``
and experts are refused (not yet checked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckptconv.commands.verify_checks import (
    Check,
    as_json,
    compare,
    default_tol,
    hf_layer,
    problem,
    read_whole,
    sample_layers,
)
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
)
from ckptconv.engine.progress import byte_progress
from ckptconv.errors import ConversionError
from ckptconv.io.dcp import DcpCheckpoint
from ckptconv.io.hf import HfCheckpoint


def verify_dcp(hf_dir: Path, dcp_dir: str | Path, *, layers: int | str, tol: float | None, seed: int,
               config: str | Path | None, check: bool, progress: bool) -> dict[str, Any]:
    """What :func:`ckptconv.commands.verify.verify` returns, for a DCP directory or TorchTitan root."""
    from ckptconv.sources.nxd import model_spec_of
    from ckptconv.titan.names import titan_model

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
        if any(spec.sparse(n) for n in range(spec.layers)) or "layers.0.attention.qkv_linear.wqkv.weight" in ckpt.entries:
            raise ConversionError(f"{dcp_dir}: verify checks dense TorchTitan models with separate wq/wk/wv; "
                                  "compare this one with ckptconv diff HF DCP")
        complex_rope = titan_model(spec).complex_rope
        tol = default_tol(hf, ckpt) if tol is None else tol
        sampled = sample_layers(spec.layers, layers)
        with byte_progress(f"verify {Path(dcp_dir).name}", len(sampled), quiet=not progress, of="layers") as advance:
            for layer in sampled:
                x = torch.randn(2, 16, spec.hidden, generator=generator)
                checks = _check_layer(x, spec, hf_layer(hf, layer), _titan_layer(ckpt, layer), complex_rope, tol)
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


def _titan_layer(ckpt: DcpCheckpoint, layer: int) -> dict[str, torch.Tensor]:
    prefix = f"layers.{layer}."
    return {k[len(prefix):]: read_whole(ckpt, k) for k, e in ckpt.entries.items() if k.startswith(prefix) and e.is_tensor}


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


def _check_layer(x: torch.Tensor, spec: ModelSpec, hf_w: dict[str, torch.Tensor], w: dict[str, torch.Tensor],
                 complex_rope: bool, tol: float) -> list[Check]:
    eps = float(spec.config.get("rms_norm_eps", 1e-6))
    dense = dense_layer(x, hf_w, spec.config, spec.head_dim, window=spec.window)
    heads = _titan_attention(rms_norm(x, w["attention_norm.weight"], eps), w, spec, complex_rope, eps)
    attention = heads @ w["attention.wo.weight"].t()
    x1 = x + attention
    h2 = rms_norm(x1, w["ffn_norm.weight"], eps)
    m = mlp(h2, w["feed_forward.w1.weight"], w["feed_forward.w3.weight"], w["feed_forward.w2.weight"])
    checks = [compare("attention", attention, dense["attention"]), compare("mlp", m, dense["mlp"]),
              compare("output", x1 + m, dense["output"])]
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
