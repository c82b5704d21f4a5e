"""Tiny Mixtral and Qwen3-MoE models, and their reference training: the transformers class, one forward per
micro-batch with ``output_router_logits=True`` (its loss is the cross-entropy plus ``router_aux_loss_coef`` times
``load_balancing_loss_func`` of that micro-batch), the gradient of the mean over the global batch's micro-batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nxdtrain.config.options import TrainConfig
from nxdtrain.data.rows import global_batches
from nxdtrain.optim import make_torch_optimizer, param_groups
from tests.conftest import hf_state
from tests.nxdtrain.reference import optimizer_step

# hidden 16 != expert intermediate 24, 4 experts top-2, GQA (4 heads over 2 K/V heads), 3 layers (pp 2 splits 1 + 2);
# Qwen3-MoE's layer 1 dense (mlp_only_layers) with intermediate 20, top-k weights not renormalized.
COMMON = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=64,
              num_experts_per_tok=2, num_hidden_layers=3, max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=24, num_local_experts=4),
    "qwen3_moe": dict(intermediate_size=20, moe_intermediate_size=24, num_experts=4, mlp_only_layers=[1],
                      norm_topk_prob=False),
}


def make_moe(path: Path, family: str, *, coef: float = 0.02, seed: int = 3) -> Path:
    """``save_pretrained`` of a random tiny MoE model; routers, norms and every weight random and distinct."""
    import transformers

    cls, config_cls = ((transformers.MixtralForCausalLM, transformers.MixtralConfig) if family == "mixtral" else
                       (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig))
    config = config_cls(**COMMON, **FAMILIES[family], router_aux_loss_coef=coef)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            elif "gate" in name and "experts" not in name:  # the router: Qwen3-MoE's starts at zero (ties)
                param.copy_(0.5 * torch.randn_like(param))
    model.save_pretrained(path)
    return path


def train_moe_reference(hf_dir: Path, cfg: TrainConfig, out: Path, *, moments: dict[str, dict[str, torch.Tensor]] | None = None
                        ) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Per-step cross-entropy, per-step aux loss (both averaged over the global batch) and the final weights as
    saved by transformers (per-expert names); ``moments``, when given, receives each parameter's optimizer state
    (``exp_avg``, ``exp_avg_sq``, ... by its HF name)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    coef = model.config.router_aux_loss_coef
    optimizer = make_torch_optimizer(param_groups(list(model.named_parameters()), cfg.optim.weight_decay), cfg.optim,
                                     lr=cfg.optim.lr)
    losses, auxes = [], []
    for step, ids in enumerate(global_batches(cfg, model.config.vocab_size), start=1):
        chunks = ids.split(cfg.data.mbs)
        ce = aux = 0.0
        for chunk in chunks:
            result = model(input_ids=chunk, labels=chunk, output_router_logits=True)
            (result.loss / len(chunks)).backward()
            ce += (result.loss - coef * result.aux_loss).item() / len(chunks)
            aux += result.aux_loss.item() / len(chunks)
        optimizer_step(model, optimizer, step, cfg)
        losses.append(ce)
        auxes.append(aux)
    if moments is not None:
        moments.update({name: dict(optimizer.state[param]) for name, param in model.named_parameters()})
    model.save_pretrained(out)
    return losses, auxes, hf_state(out)
