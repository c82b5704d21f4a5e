"""--resume reads the tag through ckptconv's checked reads: a damaged tag fails before any training step."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptconv.io.torchzip_read import TorchZipReader
from tests.nxdtrain.harness import run_world, train_options

SHARD = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


@pytest.fixture(scope="module")
def tag(nxd_model, tmp_path_factory) -> Path:
    """A done tag of one step (tp 1 x pp 1), full state."""
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    root = tmp_path_factory.mktemp("checked-resume")
    run_world(1, resume=str(src), checkpoint_dir=str(root / "ckpt"), log_jsonl=str(root / "log.jsonl"),
              **train_options(optimizer="sgd", steps=1))
    assert (root / "ckpt/step_1/done").is_file()
    return root / "ckpt/step_1"


def flip_inside(path: Path, key: str) -> str:
    """Flip one byte inside tensor ``key``; return its zip record's name."""
    with TorchZipReader(path) as reader:
        offset = reader.entry(key).data_offset
        record = next(e.name for e in reader._zip.values() if reader._data_offset(e) == offset)
    with open(path, "r+b") as f:
        f.seek(offset + 3)
        byte = f.read(1)[0]
        f.seek(offset + 3)
        f.write(bytes([byte ^ 0x10]))
    return record


def resume(tag: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--resume", str(tag), "--steps", "2", "--data", "synthetic",
            "--seq-len", "16", "--gbs", "4", "--mbs", "1", "--optimizer", "sgd", "--log-jsonl", str(tmp_path / "log.jsonl"),
            "--no-checkpoint",
            # the schedule and data order the tag recorded (train_options; a resume that changes them is refused)
            "--lr", "1e-3", "--min-lr", "1e-4", "--warmup", "1", "--seed", "7", "--decay-steps", "1"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("damaged", ["model", "optim"])
def test_resume_of_a_damaged_tag_fails_before_training(tag, tmp_path, damaged):
    copy = shutil.copytree(tag, tmp_path / "step_1")
    rel = SHARD if damaged == "model" else SHARD.replace("model/", "optim/")
    path = copy / rel
    if damaged == "model":
        record = flip_inside(path, "model.layers.0.mlp.down_proj.weight")
        expected = (rf"nxdtrain: error: --resume {re.escape(str(copy))}: {re.escape(str(path))}: record "
                    rf"{re.escape(record)} has CRC-32 [0-9a-f]{{8}}, the zip directory records [0-9a-f]{{8}}; the file "
                    r"is corrupt; resume from another tag")
    else:  # optimizer state is read lazily like a shard: the zip record's CRC-32 catches it
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
        expected = (rf"nxdtrain: error: --resume {re.escape(str(copy))}: {re.escape(str(path))}: record "
                    r"\S+ has CRC-32 [0-9a-f]{8}, the zip directory records [0-9a-f]{8}; the file is corrupt; resume "
                    r"from another tag")
    result = resume(copy, tmp_path)
    assert result.returncode == 1, result.stderr
    assert re.search(f"^{expected}$", result.stderr, re.MULTILINE), result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "log.jsonl").exists() or (tmp_path / "log.jsonl").read_text() == ""  # no step ran
