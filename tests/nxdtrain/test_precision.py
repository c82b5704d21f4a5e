"""--precision auto: fp32 on cpu (XLA:CPU too), bf16 with fp32 masters on accelerators; a resumed checkpoint's
precision first; the choice and its reason are one line at start."""

from __future__ import annotations

import pytest

import nxdtrain.device as device
from nxdtrain.config.options import TrainConfig


def config(**values) -> TrainConfig:
    return TrainConfig.from_flat({"resume": "x", "data": "synthetic", **values})


@pytest.mark.parametrize("kind,accelerator,expected", [
    ("cpu", None, "fp32"), ("cuda", None, "bf16"), ("xla", "NEURON", "bf16"), ("xla", None, "fp32"),
])
def test_auto_follows_the_device(monkeypatch, kind, accelerator, expected):
    monkeypatch.setattr(device, "pjrt_accelerator", lambda: accelerator)
    cfg, line = config().with_precision(kind, None)
    assert cfg.precision == expected
    other = "bf16" if expected == "fp32" else "fp32"
    assert line == f"precision {expected} (the default on {kind}; --precision {other} to change it)"


def test_default_is_auto_and_explicit_values_stay():
    assert config().precision == "auto"
    cfg, line = config(precision="bf16").with_precision("cpu", None)
    assert (cfg.precision, line) == ("bf16", "precision bf16 (--precision)")


def test_a_resumed_checkpoint_keeps_its_precision_and_a_change_is_said():
    cfg, line = config().with_precision("cpu", "bf16")
    assert (cfg.precision, line) == ("bf16", "precision bf16 (recorded in the checkpoint)")
    cfg, line = config(precision="fp32").with_precision("cuda", "bf16")
    assert (cfg.precision, line) == ("fp32", "precision fp32 (--precision; the checkpoint was trained in bf16)")
