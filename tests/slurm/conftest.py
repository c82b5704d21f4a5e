"""The Slurm lane's fixtures. These tests need the cluster tools/slurm_lane.sh starts (``make test-slurm``); anywhere
else they are skipped. The reference is the same work done directly on this machine, without Slurm: ``to-nxd``,
``nxdtrain run --nproc 2`` and ``to-hf`` of the same inputs with the same flags."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import make_tiny_llama
from tests.slurm.cluster import losses

HERE = Path(__file__).resolve().parent
# hidden != intermediate, heads != KV heads: a wrong split of q/k/v or of the MLP would show in the bytes
MODEL = dict(hidden=64, heads=8, kv_heads=2, head_dim=8, layers=4, vocab=128, intermediate=96)
# Four shards of ~10 MB: the cancel test holds the conversion after its first shard bytes (tests/slurm/hold).
BIG_MODEL = dict(hidden=512, heads=8, kv_heads=2, head_dim=64, layers=4, vocab=2048, intermediate=1024,
                 max_shard_size="10MB")
SLOW_CONVERT = ("--workers", "1", "--max-memory", "1MiB", "--hash", "sha256")
LAYOUT = ["--tp", "2", "--pp", "1", "--qkv-linear", "--fuse-qkv", "--kv-size-multiplier", "1"]  # convert.sbatch's
EXPORT = ["--dtype", "source", "--max-shard-size", "5GB"]  # export.sbatch's defaults
STEPS, FREQ = 24, 4
# nxdtrain run's flags after the template's own (--resume auto --init INIT --tp 2 --pp 1 --checkpoint-dir ...)
TRAIN_ARGS = ("--steps", str(STEPS), "--seq-len", "16", "--gbs", "4", "--precision", "fp32")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SLURM_LANE_STATE"):
        return
    skip = pytest.mark.skip(reason="needs the Slurm lane's cluster: make test-slurm (tools/slurm_lane.sh)")
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


def template_env(**env: str) -> dict[str, str]:
    """The variables every submission here sets: the layout above, two nodes' worth of processes (one per node)."""
    return {"TP": "2", "PP": "1", "PROCS_PER_NODE": "1", "DATA": "synthetic", "CHECKPOINT_FREQ": str(FREQ), **env}


@dataclass(frozen=True)
class Reference:
    nxd: Path           # to-nxd of the tiny model
    ckpt: Path          # nxdtrain run's checkpoint root
    losses: dict[int, float]
    hf: Path            # to-hf of the root's newest tag


@pytest.fixture(scope="session")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("slurm-hf") / "hf", **MODEL)


@pytest.fixture(scope="session")
def big_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("slurm-big") / "hf", **BIG_MODEL)


@pytest.fixture(scope="session")
def reference(hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The three steps run directly, as one would on a single machine."""
    from ckptconv.cli.main import main as ckptconv

    root = tmp_path_factory.mktemp("slurm-reference")
    nxd, ckpt, log, out = root / "nxd", root / "ckpt", root / "train.jsonl", root / "hf"
    assert ckptconv(["to-nxd", str(hf), str(nxd), *LAYOUT, "--quiet"]) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # no Slurm: nxdtrain's own launcher
    train = subprocess.run([sys.executable, "-m", "nxdtrain.cli", "run", "--nproc", "2", "--resume", "auto", "--init",
                            str(nxd), "--tp", "2", "--pp", "1", "--checkpoint-dir", str(ckpt), "--checkpoint-freq",
                            str(FREQ), "--data", "synthetic", *TRAIN_ARGS, "--log-jsonl", str(log)],
                           env=env, capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr
    assert ckptconv(["to-hf", str(ckpt), str(out), *EXPORT, "--quiet"]) == 0
    return Reference(nxd, ckpt, losses(log), out)
