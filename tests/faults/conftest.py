"""Fixtures of the fault suite: one tiny HF model (sharded, with an index) and its NxD conversion."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import make_tiny_llama

MODEL = dict(hidden=64, heads=8, kv_heads=2, head_dim=8, layers=2, vocab=128, intermediate=96)


@pytest.fixture(scope="session")
def fault_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer Llama saved in several safetensors files with model.safetensors.index.json."""
    path = make_tiny_llama(tmp_path_factory.mktemp("fault-hf") / "hf", max_shard_size="100KB", **MODEL)
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="session")
def fault_nxd(tmp_path_factory: pytest.TempPathFactory, fault_hf: Path) -> Path:
    """``fault_hf`` converted to tp 2 x pp 1 NxD shards."""
    from ckptconv.commands.api import RunOptions, to_nxd

    out = tmp_path_factory.mktemp("fault-nxd") / "nxd"
    to_nxd(fault_hf, out, tp=2, options=RunOptions(quiet=True, workers=2))
    return out


@pytest.fixture
def hf_copy(tmp_path: Path, fault_hf: Path) -> Path:
    return Path(shutil.copytree(fault_hf, tmp_path / "src-hf"))


@pytest.fixture
def nxd_copy(tmp_path: Path, fault_nxd: Path) -> Path:
    return Path(shutil.copytree(fault_nxd, tmp_path / "src-nxd"))


@pytest.fixture(scope="session")
def medium_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A larger model (about 10 MB) so that a conversion lasts long enough to be killed in the middle."""
    return make_tiny_llama(tmp_path_factory.mktemp("fault-medium") / "hf", hidden=256, heads=8, kv_heads=2,
                           head_dim=32, layers=4, vocab=512, intermediate=512, max_shard_size="3MB")
