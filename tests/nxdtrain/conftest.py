"""Fixtures for nxdtrain: tiny HF models, their NxD conversions, and HF reference runs (all cached per session)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdtrain.config.options import TrainConfig
from tests.conftest import make_tiny_llama
from tests.nxdtrain.harness import MODELS, convert
from tests.nxdtrain.reference import train_reference


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("nxdtrain-hf")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = make_tiny_llama(root / name, **MODELS[name])
        return cache[name]

    return get


@pytest.fixture(scope="session")
def nxd_model(tmp_path_factory: pytest.TempPathFactory, hf_model: Callable[[str], Path]) -> Callable[..., Path]:
    """``nxd_model(name, tp=, pp=, attention=, fuse_qkv=, kv_size_multiplier=, ...)``: a converted directory."""
    root = tmp_path_factory.mktemp("nxdtrain-nxd")

    def get(name: str, **layout: Any) -> Path:
        label = name + "".join(f"-{k}{v}" for k, v in sorted(layout.items()))
        return convert(hf_model(name), root / label, **layout)

    return get


@pytest.fixture(scope="session")
def reference(hf_model: Callable[[str], Path]) -> Callable[..., tuple[list[float], dict[str, torch.Tensor]]]:
    """``reference(name, **train options)``: HF losses and final weights, cached by options."""
    cache: dict[str, Any] = {}

    def get(name: str, **options: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
        keys = ("optimizer", "lr", "min_lr", "warmup", "schedule", "decay_steps", "weight_decay", "clip_grad",
                "data", "seq_len", "gbs", "steps", "seed", "shuffle")
        key = name + repr(sorted((k, v) for k, v in options.items() if k in keys))
        if key not in cache:
            cfg = TrainConfig.from_flat({k: v for k, v in options.items() if k in keys} | {"resume": "unused"})
            cache[key] = train_reference(hf_model(name), cfg)
        return cache[key]

    return get
