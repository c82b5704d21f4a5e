"""NxDT YAML as users have it: every unknown key at once, interpolation, paths, exp_manager, messages that name
the YAML key, and a stock-shaped Llama-3 70B file (fixtures/nxdt/) run here with only its paths changed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nxdtrain.cli import build_parser, load_config
from nxdtrain.errors import TrainError

REPO = Path(__file__).resolve().parents[3]
STOCK = REPO / "fixtures" / "nxdt" / "hf_llama3_70B.yaml"


def config(tmp_path: Path, text: str, *flags: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(build_parser().parse_args(["run", "--config", str(path), *flags]))


def error(tmp_path: Path, text: str, *flags: str) -> str:
    with pytest.raises(TrainError) as info:
        config(tmp_path, text, *flags)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_every_unknown_key_in_one_line_with_the_nearest_known_key(tmp_path):
    message = error(tmp_path, "resume: /x\nlearning_rate: 3.0e-4\nseq-len: 512\nglobal_batch: 8\n"
                              "distributed_strategy: {tensor_model_paralel_size: 8, zero1: true}\n"
                              "model: {optim: {sched: {warmup_step: 10}}}\n"
                              "trainer: {devices: 32, max_step: 100}\n")  # devices: NxDT's, ignored, not unknown
    path = tmp_path / "run.yaml"
    assert message.startswith(f"--config {path}: unknown keys learning_rate (nearest: lr); seq-len (nearest: seq_len); "
                              "global_batch (nearest: data.global_batch_size)")  # an NxDT key can be the nearest
    for part in ("distributed_strategy.tensor_model_paralel_size (nearest: "
                 "distributed_strategy.tensor_model_parallel_size)",
                 "model.optim.sched.warmup_step (nearest: model.optim.sched.warmup_steps)",
                 "trainer.max_step (nearest: trainer.max_steps)"):
        assert part in message
    assert "devices" not in message and message.count("unknown keys") == 1


def test_interpolations_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NXDT_CKPT", "/fsx/ck")
    monkeypatch.delenv("NXDT_UNSET", raising=False)
    cfg = config(tmp_path, "resume: ${oc.env:NXDT_CKPT}/start\n"
                           "data: ${oc.env:NXDT_UNSET,synthetic}\n"
                           "trainer: {max_steps: 40}\n"
                           "model: {optim: {lr: 1.0e-3, sched: {name: CosineAnnealing, max_steps: '${trainer.max_steps}'}}}\n")
    assert (cfg.checkpoint.resume, cfg.data.data, cfg.steps, cfg.optim.decay_steps) == ("/fsx/ck/start", "synthetic",
                                                                                          40, 40)
    assert (cfg.optim.schedule, cfg.optim.min_lr) == ("CosineAnnealing", 0.0)  # NeMo's default floor
    message = error(tmp_path, "resume: /x\nmodel: {optim: {sched: {max_steps: '${trainer.max_step}'}}}\n")
    assert message.endswith("'${trainer.max_step}' refers to trainer.max_step, which the file does not have")


def test_home_and_variables_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DATA_ROOT", "/fsx/data")
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    cfg = config(tmp_path, "resume: ~/llama-nxd\ncheckpoint_dir: $HOME/ckpt\ndata: ${DATA_ROOT}/rows.jsonl\n",
                 "--log-jsonl", "~/log.jsonl")
    home = str(tmp_path / "home")
    assert cfg.checkpoint.resume == f"{home}/llama-nxd" and cfg.checkpoint.checkpoint_dir == f"{home}/ckpt"
    assert cfg.data.data == "/fsx/data/rows.jsonl" and cfg.log_jsonl == f"{home}/log.jsonl"  # flags too
    message = error(tmp_path, "resume: /x\ncheckpoint_dir: $NOT_SET_HERE/ckpt\n")
    assert message == "checkpoint_dir (run.yaml) '$NOT_SET_HERE/ckpt': environment variable NOT_SET_HERE is not set"
    assert not Path("~").exists()


def test_messages_name_the_yaml_key_the_value_came_from(tmp_path):
    assert error(tmp_path, "resume: /x\nmodel: {optim: {lr: -1}}\n") == "model.optim.lr (run.yaml) must be > 0, got -1.0"
    message = error(tmp_path, "resume: /x\ndata: synthetic\nexp_manager: {create_checkpoint_callback: false, "
                              "checkpoint_callback_params: {every_n_train_steps: 10}}\n")
    assert message == ("exp_manager.checkpoint_callback_params.every_n_train_steps (run.yaml) needs --checkpoint-dir")
    # the same problem from flags names the flags
    with pytest.raises(TrainError, match=r"^--checkpoint-freq needs --checkpoint-dir$"):
        load_config(build_parser().parse_args(["run", "--resume", "/x", "--data", "synthetic", "--checkpoint-freq",
                                               "10"]))
    assert error(tmp_path, "resume: /x\nseq_len: 512\ndata: {seq_length: 1024}\n") == (
        f"--config {tmp_path / 'run.yaml'}: data.seq_length 1024 and seq_len (run.yaml) 512 set the same option "
        "differently; keep one")


def test_exp_manager_directories_and_resume(tmp_path, capsys):
    text = ("exp_manager: {exp_dir: /fsx/exp, name: llama, create_tensorboard_logger: true, resume_if_exists: true,"
            " resume_from_checkpoint: /fsx/llama-nxd, checkpoint_callback_params: {save_top_k: 3,"
            " every_n_train_steps: 50}}\n")
    cfg = config(tmp_path, text, "--data", "synthetic")
    ckpt = cfg.checkpoint
    assert (ckpt.resume, ckpt.init, ckpt.checkpoint_dir) == ("auto", "/fsx/llama-nxd", "/fsx/exp/llama/checkpoints")
    assert (ckpt.keep, ckpt.checkpoint_freq, cfg.tensorboard) == (3, 50, "/fsx/exp/llama")
    assert "nxdtrain: checkpoints in /fsx/exp/llama/checkpoints, TensorBoard in /fsx/exp/llama" in capsys.readouterr().err
    # flags win, and replace what the file derived for the same purpose
    cfg = config(tmp_path, text, "--resume", "/fsx/other", "--checkpoint-dir", "/fsx/ck", "--data", "synthetic")
    assert (cfg.checkpoint.resume, cfg.checkpoint.init, cfg.checkpoint.checkpoint_dir) == ("/fsx/other", None, "/fsx/ck")
    cfg = config(tmp_path, "exp_manager: {explicit_log_dir: /fsx/logs, resume_from_checkpoint: /fsx/nxd}\n"
                           "data: {train_dir: /fsx/rows.jsonl}\n")
    assert (cfg.checkpoint.resume, cfg.checkpoint.checkpoint_dir, cfg.tensorboard) == ("/fsx/nxd", "/fsx/logs/checkpoints",
                                                                                      None)
    cfg = config(tmp_path, "resume: /x\ndata: synthetic\nexp_manager: {create_checkpoint_callback: false}\n")
    assert (cfg.checkpoint.no_checkpoint, cfg.checkpoint.checkpoint_dir) == (True, None)


def test_validation_keys(tmp_path):
    cfg = config(tmp_path, "resume: /x\ndata: {train_dir: /fsx/rows, val_dir: /fsx/held}\n"
                           "trainer: {val_check_interval: 100, limit_val_batches: 4}\n")
    assert (cfg.data.eval_data, cfg.data.eval_every, cfg.data.eval_batches) == ("/fsx/held", 100, 4)
    cfg = config(tmp_path, "resume: /x\ndata: {train_dir: /fsx/rows, val_dir: /fsx/held}\n"
                           "trainer: {val_check_interval: 100, limit_val_batches: 0.0}\n")  # NxDT's recipes: off
    assert (cfg.data.eval_data, cfg.data.eval_every) == (None, 0)


def test_the_stock_70b_file_reads_as_nxdt_means_it(tmp_path):
    cfg = config(tmp_path, STOCK.read_text())
    par, opt, data, ckpt = cfg.parallel, cfg.optim, cfg.data, cfg.checkpoint
    assert (par.tp, par.pp, par.kv_replicator, par.zero1, par.sequence_parallel) == (32, 8, 4, True, True)
    assert (par.qkv_linear, par.fuse_qkv, par.activation_checkpointing) == (True, True, "selective")
    assert (data.gbs, data.mbs, data.seq_len, data.data) == (512, 1, 8192, "/fsx/data/web_corpus_llama3_tokenized_8k")
    # weight_decay: the file says 0.05, NxDT's HF models decay with their own 0.01 (test_nxdt_configs)
    assert (opt.optimizer, opt.lr, opt.weight_decay, opt.beta1, opt.beta2) == ("adamw", 1.2e-5, 0.01, 0.9, 0.95)
    assert (opt.schedule, opt.warmup, opt.decay_steps, opt.min_lr) == ("CosineAnnealing", 300, 12000, 1.2e-6)
    assert (cfg.steps, opt.clip_grad, cfg.precision, cfg.seed, cfg.log_every) == (12000, 1.0, "bf16", 2024, 1)
    assert (ckpt.resume, ckpt.init, ckpt.keep, ckpt.checkpoint_freq, ckpt.xser) == (
        "auto", "/fsx/checkpoints/llama3-70b-nxd-tp32-pp8", 2, 250, True)
    assert (ckpt.checkpoint_dir, cfg.tensorboard) == ("/fsx/experiments/llama3_70b_cpt/checkpoints",
                                                      "/fsx/experiments/llama3_70b_cpt")
    assert (data.eval_data, data.eval_every) == (None, 0)


NO_DATA = ("--data is required: a save_to_disk dataset dir, a .jsonl/.json(.gz) file, or a directory or glob of those "
           "(an NxDT YAML's data.train_dir); --data synthetic trains on random tokens")


def test_a_file_without_data_is_refused_like_the_flags(tmp_path):
    """No silent random tokens: an NxDT file without data.train_dir is refused as a run without --data is; synthetic
    rows are asked for by name (our key or NxDT's), or by the flag."""
    stock = STOCK.read_text()
    no_train_dir, count = re.subn(r"^\s*train_dir: .*\n", "", stock, flags=re.M)
    assert count == 1
    assert error(tmp_path, no_train_dir) == NO_DATA
    assert error(tmp_path, "resume: /x\n") == NO_DATA
    with pytest.raises(TrainError, match=f"^{re.escape(NO_DATA)}$"):
        load_config(build_parser().parse_args(["run", "--resume", "/x"]))
    assert config(tmp_path, no_train_dir, "--data", "synthetic").data.data == "synthetic"
    assert config(tmp_path, "resume: /x\ndata: synthetic\n").data.data == "synthetic"
    assert config(tmp_path, "resume: /x\ndata: {train_dir: synthetic}\n").data.data == "synthetic"


def test_the_stock_70b_file_trains_a_tiny_model_with_only_its_paths_changed(tmp_path, nxd_model, hf_model):
    """What a user does: edit the four paths, shrink the run with flags; then requeue the same command."""
    import datasets

    src = nxd_model("gqa2", tp=2, pp=1, attention="qkv_linear", fuse_qkv=True)
    rows = [[(5 * r + t) % 128 for t in range(16)] for r in range(16)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "tokenized"))
    paths = {"exp_dir": tmp_path / "experiments", "resume_from_checkpoint": src, "train_dir": tmp_path / "tokenized",
             "model_config": hf_model("gqa2") / "config.json"}
    text = STOCK.read_text()
    for key, value in paths.items():
        text, count = re.subn(rf"^(\s*{key}: ).*$", rf"\g<1>{value}", text, flags=re.M)
        assert count == 1, key
    edited = tmp_path / "hf_llama3_70B.yaml"
    edited.write_text(text)
    assert [a for a, b in zip(STOCK.read_text().splitlines(), text.splitlines(), strict=True) if a != b] == [
        line for line in STOCK.read_text().splitlines() if re.match(rf"^\s*({'|'.join(paths)}): ", line)]
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--config", str(edited), "--nproc", "2",
            "--tp", "2", "--pp", "1", "--kv-replicator", "1", "--gbs", "4", "--seq-len", "16"]
    first = subprocess.run([*argv, "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    log_dir = tmp_path / "experiments" / "llama3_70b_cpt"
    assert f"nxdtrain: resume: auto: no completed tag in {log_dir / 'checkpoints'} yet; weights only from {src}" \
        in first.stderr
    assert "nxdtrain: precision bf16 (precision.type (hf_llama3_70B.yaml))" in first.stderr.splitlines()
    assert sorted(p.name for p in (log_dir / "checkpoints").iterdir()) == ["step_2"]
    assert any(p.name.startswith("events.out.tfevents") for p in log_dir.iterdir())  # create_tensorboard_logger
    user = json.loads((log_dir / "checkpoints" / "step_2" / "ckptconv.json").read_text())
    assert user["flavour"] == "xser-split"  # exp_manager.save_xser
    second = subprocess.run([*argv, "--steps", "3"], capture_output=True, text=True, timeout=600)  # requeued
    assert second.returncode == 0, second.stderr
    assert f"nxdtrain: resume: auto: full state from newest completed tag step_2 of {log_dir / 'checkpoints'}" \
        in second.stderr
    assert sorted(p.name for p in (log_dir / "checkpoints").iterdir()) == ["step_2", "step_3"]  # save_top_k 2
    assert not os.path.exists(REPO / "nemo_experiments")
