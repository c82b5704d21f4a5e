"""Learning-rate schedules against hand-computed tables; the global gradient norm counts each element once."""

from __future__ import annotations

import math

import pytest
import torch

from ckptconv.training import lr_at
from nxdtrain.config.options import OptimConfig
from nxdtrain.parallel.grads import GradPlan, global_norm


@pytest.mark.parametrize("schedule,expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 0.775, 0.55, 0.325, 0.1]),
    # cosine: 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2 for k = 1..4 after the 2 warmup steps
    ("cosine", [0.5, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55, 0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4)),
                0.1]),
])
def test_lr_schedules(schedule, expected):
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup=2, schedule=schedule)
    got = [lr_at(step, cfg, decay_steps=6) for step in range(1, 8)]
    assert got[:6] == pytest.approx(expected, abs=1e-12)
    assert got[6] == got[5]  # past decay_steps the rate stays at its end value


def test_norm_skips_replicated_rows():
    grads = {"norm": torch.full((4,), 2.0), "qkv": torch.arange(6.0).reshape(3, 2), "head": torch.ones(2, 2)}
    plan = GradPlan(uncounted={"norm": [], "qkv": [slice(1, 2)], "head": []})
    # counted: qkv rows 0 and 2 -> 0 + 1 + 16 + 25
    assert global_norm(grads, plan).item() == pytest.approx(math.sqrt(42.0))
    assert global_norm(grads, GradPlan()).item() == pytest.approx(math.sqrt(16 + 55 + 4))
