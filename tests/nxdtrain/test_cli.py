"""The command line end to end: YAML + flags, --nproc, the jsonl log, export, and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from ckptconv.commands.api import open_nxd
from ckptconv.core.layout import shard_name
from ckptconv.io.nxd_read import load_shard
from nxdtrain.cli import main
from nxdtrain.model.stage import LlamaStage
from nxdtrain.parallel.layers import TpGroup

NXDTRAIN = [sys.executable, "-m", "nxdtrain.cli"]


def nxdtrain(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NXDTRAIN, *argv], capture_output=True, text=True, timeout=timeout)


def stage_logits(tag, ids):
    """Logits of the trained tp 1 x pp 2 checkpoint, its two stages chained in this process."""
    opened = open_nxd(tag)
    ckpt, spec, layout, inv = opened.ckpt, opened.spec, opened.layout, opened.with_inv_freq
    ckpt.close()
    h = ids
    for pp in range(layout.pp):
        stage = LlamaStage(spec, layout, tp=TpGroup(), pp_rank=pp, with_inv_freq=inv)
        shard = tag / "model" / shard_name(tp_rank=0, pp_rank=pp)
        stage.load_shard_state(load_shard(shard), str(shard))
        with torch.no_grad():
            h = stage(h)
    return h


def test_run_then_export_gives_the_trained_logits(tmp_path, nxd_model, hf_model):
    from transformers import AutoModelForCausalLM

    src = nxd_model("gqa2", tp=1, pp=2, attention="qkv_linear", fuse_qkv=True)
    rows = torch.randint(0, 128, (12, 20), generator=torch.Generator().manual_seed(0)).tolist()
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    (tmp_path / "run.yaml").write_text(
        f"exp_manager: {{resume_from_checkpoint: {src}}}\n"
        "distributed_strategy: {pipeline_model_parallel_size: 2}\n"
        f"data: {{global_batch_size: 4, micro_batch_size: 1, seq_length: 16, train_dir: {tmp_path / 'rows.jsonl'}}}\n"
        "model: {optim: {lr: 1.0e-2, sched: {warmup_steps: 1}}}\n"
    )
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    run = nxdtrain("run", "--config", str(tmp_path / "run.yaml"), "--nproc", "2", "--steps", "3", "--precision", "fp32",
                   "--checkpoint-dir", str(ckpt), "--checkpoint-freq", "2", "--log-jsonl", str(log), "--no-shuffle")
    assert run.returncode == 0, run.stderr
    assert f"nxdtrain: resume: weights only from {src} (no optimizer state (a converted checkpoint))" in run.stderr
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["step"], r["consumed_samples"]) for r in lines] == [(1, 4), (2, 8), (3, 12)]
    assert set(lines[0]) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "consumed_samples", "param_norm",
                             "eval_loss"}
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_3"]

    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0  # the root: its newest completed tag, step_3
    ids = torch.tensor(rows[:2])
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        before = AutoModelForCausalLM.from_pretrained(hf_model("gqa2")).eval()(ids).logits
    ours = stage_logits(ckpt / "step_3", ids)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (before - theirs).abs().max().item() > 1e-3  # training changed the model


def test_missing_resume_path_exits_nonzero(tmp_path):
    result = nxdtrain("run", "--resume", str(tmp_path / "missing"), "--data", "synthetic", "--nproc", "2",
                      "--steps", "1")
    assert result.returncode == 1
    assert result.stderr == f"nxdtrain: error: --resume {tmp_path / 'missing'}: no such directory\n"


def test_a_run_without_data_is_refused_in_one_line(tmp_path):
    """No silent random tokens: without --data nothing starts; --data synthetic is how to ask for them."""
    result = nxdtrain("run", "--resume", str(tmp_path / "missing"), "--nproc", "2", "--no-checkpoint")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == ("nxdtrain: error: --data is required: a save_to_disk dataset dir, a .jsonl/.json(.gz) "
                             "file, or a directory or glob of those (an NxDT YAML's data.train_dir); --data synthetic "
                             "trains on random tokens\n")
    assert not (tmp_path / "missing").exists()
