"""NxDT's schedules (an NxDT YAML's model.optim.sched.name): the learning rate of every optimizer step."""

from __future__ import annotations

import pytest
import torch

from ckptconv.training import lr_at
from nxdtrain.config.options import OptimConfig
from nxdtrain.errors import TrainError


def test_linear_annealing_with_warmup_is_transformers_linear_schedule_stepped_after_each_update():
    """NxDT's LinearAnnealingWithWarmUp is transformers' linear schedule; NxDT steps it after every update."""
    from transformers import get_linear_schedule_with_warmup

    cfg = OptimConfig(lr=0.5, warmup=3, schedule="LinearAnnealingWithWarmUp")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=10)
    expected = []
    for _ in range(12):
        expected.append(optimizer.param_groups[0]["lr"])  # what this update runs at
        optimizer.step()
        scheduler.step()
    assert [lr_at(n, cfg, decay_steps=10) for n in range(1, 13)] == pytest.approx(expected, abs=1e-12)
    assert expected[0] == 0.0 and expected[-2:] == [0.0, 0.0]  # starts at 0 and ends at 0: no floor


def test_cosine_annealing_is_nemos_by_hand():
    """NeMo's CosineAnnealing (warmup (s+1)/(W+1), cosine to min_lr by max_steps), W 2, max_steps 6."""
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup=2, schedule="CosineAnnealing")
    by_hand = [1 / 3, 2 / 3, 1.0, 0.1 + 0.45 * (1 + 2**-0.5), 0.55, 0.1 + 0.45 * (1 - 2**-0.5), 0.1, 0.1]
    assert [lr_at(n, cfg, decay_steps=6) for n in range(1, 9)] == pytest.approx(by_hand, abs=1e-12)


def test_nxdt_schedules_default_to_no_floor_and_linear_takes_none():
    assert OptimConfig(lr=1.0, schedule="CosineAnnealing").min_lr == 0.0  # NeMo's default
    assert OptimConfig(lr=1.0, schedule="cosine").min_lr == pytest.approx(0.1)  # ours: a tenth
    with pytest.raises(TrainError, match="LinearAnnealingWithWarmUp decays to 0 .* got --min-lr 0.1; drop --min-lr"):
        OptimConfig(lr=1.0, min_lr=0.1, schedule="LinearAnnealingWithWarmUp")
