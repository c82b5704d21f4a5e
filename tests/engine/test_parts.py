"""N cooperating processes (--part K/N, srun, torchrun) write exactly the files one process writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptconv.cli.main import main
from ckptconv.core.layout import ParallelLayout
from ckptconv.core.mapping import hf_shapes
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import plan_to_nxd
from ckptconv.engine.finalize import assign_files, detect_part

GQA = dict(heads=8, kv_heads=2, head_dim=8, layers=6)


def files_of(root: Path) -> dict[str, str]:
    meta = json.loads((root / "ckptconv.json").read_text())
    assert not (root / ".ckptconv-tmp").exists()
    on_disk = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != "ckptconv.json")
    assert on_disk == sorted(meta["files"])
    return {rel: rec["blake3"] for rel, rec in meta["files"].items()}


def test_parts_are_disjoint_balanced_and_cover_everything():
    spec = ModelSpec(hidden=64, heads=8, kv_heads=2, head_dim=8, intermediate=96, vocab=128, layers=6, tied=False)
    plan = plan_to_nxd(spec, ParallelLayout(tp=4, pp=3, attention="qkv_linear", kvm=2),
                       {k: torch.float32 for k in hf_shapes(spec, with_inv_freq=False)})
    parts = [assign_files(plan, (k, 3)) for k in range(3)]
    assert set().union(*parts) == {f.path for f in plan.files}
    assert sum(len(p) for p in parts) == len(plan.files)
    sizes = {f.path: f.nbytes for f in plan.files}
    loads = [sum(sizes[p] for p in part) for part in parts]
    assert max(loads) - min(loads) <= max(sizes.values())


def test_part_comes_from_torchrun_or_srun(monkeypatch: pytest.MonkeyPatch):
    for var in ("SLURM_PROCID", "SLURM_NTASKS", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert detect_part() == (0, 1)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    assert detect_part() == (1, 3)
    # torchrun inside an srun task: the worker's own RANK/WORLD_SIZE, not the task's (ckptconv.engine.launcher)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert detect_part() == (2, 4)
    assert detect_part((0, 2)) == (0, 2)


@pytest.mark.parametrize("direction", ["to-nxd", "to-hf"])
def test_two_processes_write_what_one_writes(tiny_models, tmp_path: Path, direction: str):
    src = tiny_models("gqa", **GQA)
    if direction == "to-hf":
        assert main(["to-nxd", str(src), str(tmp_path / "nxd"), "--tp", "2", "--pp", "3", "--qkv-linear", "--quiet"]) == 0
        src = tmp_path / "nxd"
    flags = ["--tp", "2", "--pp", "3", "--qkv-linear"] if direction == "to-nxd" else ["--max-shard-size", "60KB"]
    assert main([direction, str(src), str(tmp_path / "single"), *flags, "--quiet"]) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    procs = [
        subprocess.Popen([sys.executable, "-m", "ckptconv.cli", direction, str(src), str(tmp_path / "parts"), *flags,
                          "--quiet", "--part", f"{k}/2", "--workers", "1"], env=env)
        for k in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert files_of(tmp_path / "parts") == files_of(tmp_path / "single")


def test_finalize_waits_for_every_part(tiny_models, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    src = tiny_models("gqa", **GQA)
    out = tmp_path / "out"
    flags = [str(src), str(out), "--tp", "2", "--pp", "2", "--quiet"]
    assert main(["to-nxd", *flags, "--part", "1/2"]) == 0
    assert not (out / "ckptconv.json").exists()
    assert main(["finalize", str(out)]) == 1
    assert "part(s) 0/2 not done yet" in capsys.readouterr().err
    assert main(["to-nxd", *flags, "--part", "0/2"]) == 0  # the last part finalizes
    files_of(out)
    assert main(["finalize", str(out)]) == 1
    assert "nothing to finalize" in capsys.readouterr().err
