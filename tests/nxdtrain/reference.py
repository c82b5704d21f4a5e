"""The reference: the family's transformers class (LlamaForCausalLM, MistralForCausalLM, ...) trained in one process
on the same rows."""

from __future__ import annotations

from pathlib import Path

import torch

from ckptconv.training import lr_at
from nxdtrain.config.options import TrainConfig
from nxdtrain.data.rows import global_batches
from nxdtrain.optim import make_torch_optimizer, param_groups


def train_reference(hf_dir: Path, cfg: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step losses and final weights of the HF model trained on the whole global batch at once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    named = list(model.named_parameters())
    optimizer = make_torch_optimizer(param_groups(named, cfg.optim.weight_decay), cfg.optim, lr=cfg.optim.lr)
    losses = []
    for step, ids in enumerate(global_batches(cfg, model.config.vocab_size), start=1):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer_step(model, optimizer, step, cfg)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> None:
    """Step ``step`` of a reference loop after its backward: clipping, the schedule's lr, the step, zeroed grads."""
    if cfg.optim.clip_grad > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg.optim, decay_steps=cfg.decay_steps)
    optimizer.step()
    optimizer.zero_grad()
