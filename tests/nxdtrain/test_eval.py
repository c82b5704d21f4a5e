"""--eval-data/--eval-every (the held-out loss), parameter norms, and --resume auto, from one tp 2 x pp 2 run
checked against transformers on the exported weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from ckptconv.cli.main import main as ckptconv_main
from nxdtrain.checkpoint.resume import resolve_start
from nxdtrain.config.options import CheckpointConfig
from nxdtrain.errors import TrainError

SEQ, GBS = 16, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory, nxd_model):
    """Two global batches of held-out rows evaluated after step 2, then a second run resuming with --resume auto."""
    tmp = tmp_path_factory.mktemp("eval")
    src = nxd_model("gqa2", tp=2, pp=2, attention="qkv_linear", fuse_qkv=True)
    generator = torch.Generator().manual_seed(3)
    for name, count in (("train.jsonl", 16), ("held.jsonl", 10)):  # 10 held-out rows: 2 full batches of 4
        rows = torch.randint(0, 128, (count, SEQ), generator=generator).tolist()
        (tmp / name).write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--nproc", "4", "--tp", "2", "--pp", "2", "--resume", "auto",
            "--init", str(src), "--checkpoint-dir", str(tmp / "ckpt"), "--data", str(tmp / "train.jsonl"),
            "--eval-data", str(tmp / "held.jsonl"), "--eval-every", "2", "--seq-len", str(SEQ), "--gbs", str(GBS),
            "--lr", "1e-2", "--decay-steps", "3", "--precision", "fp32", "--log-jsonl", str(tmp / "log.jsonl"), "--tensorboard",
            str(tmp / "tb")]
    first = subprocess.run([*argv, "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    exported = tmp / "hf-step2"
    assert ckptconv_main(["to-hf", str(tmp / "ckpt" / "step_2"), str(exported), "--quiet"]) == 0
    second = subprocess.run([*argv, "--steps", "3"], capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    log = [json.loads(line) for line in (tmp / "log.jsonl").read_text().splitlines()]
    return {"tmp": tmp, "src": src, "first": first.stderr, "second": second.stderr, "log": log, "hf": exported}


def test_eval_loss_equals_transformers_on_the_held_out_rows(run):
    from transformers import AutoModelForCausalLM

    log = {r["step"]: r for r in run["log"]}
    assert [r["step"] for r in run["log"]] == [1, 2, 3]
    assert log[1]["eval_loss"] is None and log[3]["eval_loss"] is None  # --eval-every 2
    held = [json.loads(line)["input_ids"] for line in (run["tmp"] / "held.jsonl").read_text().splitlines()]
    ids = torch.tensor(held[: 2 * GBS])  # the first two whole global batches, in file order
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(run["hf"]).eval()(ids, labels=ids).loss.item()
    assert abs(log[2]["eval_loss"] - reference) <= 1e-5
    assert abs(log[2]["eval_loss"] - log[2]["loss"]) > 1e-3  # not the training loss again
    assert "eval loss" in run["first"]


def test_param_norm_is_the_norm_of_the_whole_model_after_the_step(run):
    from safetensors.torch import load_file

    state = {}
    for path in sorted(run["hf"].glob("*.safetensors")):
        state.update(load_file(path))
    expected = torch.sqrt(sum(t.double().pow(2).sum() for t in state.values())).item()
    log = {r["step"]: r for r in run["log"]}
    assert log[2]["param_norm"] == pytest.approx(expected, rel=1e-6)
    assert log[1]["param_norm"] != log[2]["param_norm"] and all(r["grad_norm"] > 0 for r in run["log"])


def test_resume_auto_starts_from_init_then_continues_from_the_newest_tag(run):
    assert f"nxdtrain: resume: auto: no completed tag in {run['tmp'] / 'ckpt'} yet; weights only from {run['src']}" \
        in run["first"]
    assert f"nxdtrain: resume: auto: full state from newest completed tag step_2 of {run['tmp'] / 'ckpt'}" \
        in run["second"]


def test_tensorboard_has_our_tags_and_nxdts(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run["tmp"] / "tb"))
    events.Reload()
    log = {r["step"]: r for r in run["log"]}

    def series(tag: str) -> dict[int, float]:
        return {s.step: s.value for s in events.Scalars(tag)}

    for field, tags in (("loss", ("train/loss", "reduced_train_loss")), ("lr", ("train/lr", "lr")),
                        ("grad_norm", ("train/grad_norm", "gradient_norm")),
                        ("param_norm", ("train/param_norm", "parameter_norm")),
                        ("consumed_samples", ("train/consumed_samples", "consumed_samples"))):
        for tag in tags:
            assert series(tag) == pytest.approx({s: r[field] for s, r in log.items()}, rel=1e-6), tag
    for tag in ("eval/loss", "val_loss"):
        assert series(tag) == pytest.approx({2: log[2]["eval_loss"]}, rel=1e-6), tag
    assert series("global_step") == {1: 1.0, 2: 2.0, 3: 3.0}
    assert series("throughput") == pytest.approx({s: r["tokens_per_s"] / SEQ for s, r in log.items()}, rel=1e-5)


def test_the_plot_draws_the_eval_loss(run, tmp_path):
    from nxdtrain.plot import plot_log

    figure = plot_log(run["tmp"] / "log.jsonl", tmp_path / "curves.png")
    loss_panel = next(ax for ax in figure.axes if ax.get_ylabel() == "loss")
    lines = {line.get_label(): line for line in loss_panel.get_lines()}
    assert list(lines["eval_loss"].get_xdata()) == [2]
    assert list(lines["eval_loss"].get_ydata()) == [run["log"][1]["eval_loss"]]


def test_resume_auto_takes_the_newest_completed_tag(run, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(run["tmp"] / "ckpt", root)
    shutil.copytree(root / "step_3", root / "step_9")
    (root / "step_9" / "done").unlink()  # an interrupted save: never resumed
    source = resolve_start(CheckpointConfig(resume="auto", checkpoint_dir=str(root), init=str(run["src"])))
    assert source.root == root / "step_3" and source.full
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TrainError, match=r"--resume auto: .*empty holds no completed tag yet, and no --init PATH"):
        resolve_start(CheckpointConfig(resume="auto", checkpoint_dir=str(empty)))
    with pytest.raises(TrainError, match=r"^--init .*missing: no such directory$"):
        resolve_start(CheckpointConfig(resume="auto", checkpoint_dir=str(empty), init=str(tmp_path / "missing")))
