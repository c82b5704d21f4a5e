"""Run length in epochs, fractional warmup, ``nxdtrain steps``, TensorBoard scalars and ``nxdtrain plot``."""

from __future__ import annotations

import gzip
import json
import math
import sys

import pytest
import torch

from nxdtrain.cli import PRELOAD, build_parser, load_config, main
from nxdtrain.config.options import TrainConfig
from nxdtrain.data.epochs import resolve, run_length
from nxdtrain.errors import TrainError
from nxdtrain.parallel.dist import spawn
from nxdtrain.train import run_worker
from tests.nxdtrain.harness import DIST_TIMEOUT, WORLD_TIMEOUT, read_log

ROWS, SEQ = 38, 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """38 random rows of 16 ids, as one .jsonl and as a directory of SageMaker-style .json.gz files."""
    root = tmp_path_factory.mktemp("epochs")
    rows = torch.randint(0, 128, (ROWS, SEQ), generator=torch.Generator().manual_seed(3)).tolist()
    (root / "rows.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    (root / "parts").mkdir()
    for k, start in enumerate(range(0, ROWS, 10)):
        chunk = [{"input_ids": r} for r in rows[start:start + 10]]
        (root / "parts" / f"train-{k:03d}.json.gz").write_bytes(gzip.compress(json.dumps(chunk).encode()))
    return root


def test_steps_command_equals_a_hand_calculation(corpus, capsys):
    argv = ["steps", "--data", str(corpus / "parts"), "--gbs", "4", "--tp", "2", "--epochs", "3", "--warmup", "0.05"]
    assert main([*argv, "--nproc", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 38 rows of 16; world 4 / tp 2 = dp 2; 4 / (mbs 1 x dp 2) = 2 microbatches; 38 // 4 = 9 steps per epoch
    # (2 rows dropped); 3 epochs = 27 steps; warmup ceil(27 x 0.05 = 1.35) = 2; 27 x 4 x 16 tokens trained.
    assert report == {"data": str(corpus / "parts"), "rows": 38, "seq_len": 16, "tokens": 608, "world": 4, "tp": 2,
                      "pp": 1, "cp": 1, "dp": 2, "gbs": 4, "mbs": 1, "microbatches": 2, "steps_per_epoch": 9,
                      "rows_dropped_per_epoch": 2, "epochs": 3, "steps": 27, "warmup": 2, "tokens_trained": 1728,
                      "rows_checked": 38, "long_rows": 0, "tokens_never_trained": 0}
    assert main([*argv, "--nodes", "2", "--cores-per-node", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == report
    assert main([*argv, "--nodes", "2", "--cores-per-node", "2"]) == 0
    table = capsys.readouterr().out
    for label, value in (("steps per epoch", "9"), ("total steps", "27"), ("warmup steps", "2"),
                         ("data parallel (dp)", "2"), ("tokens trained", "1,728")):
        assert any(label in line and line.rstrip(" │").endswith(value) for line in table.splitlines()), label
    # Context-parallel ranks read the same rows: world 8 = tp 2 x cp 2 x dp 2 gives the same dp and steps.
    assert main([*argv, "--nproc", "8", "--context-parallel", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {**report, "world": 8, "cp": 2}
    assert main(["steps", "--data", str(corpus / "rows.jsonl"), "--gbs", "4", "--nproc", "3", "--tp", "2"]) == 1
    assert "world size 3 (--nproc or the launcher's) is not a multiple of --tp 2 x --pp 1" in capsys.readouterr().err


def test_run_length_and_warmup_reading():
    one_epoch = run_length(rows=38, gbs=4, epochs=1, warmup=0.01)
    assert (one_epoch.steps_per_epoch, one_epoch.dropped_per_epoch, one_epoch.steps, one_epoch.warmup) == (9, 2, 9, 1)
    assert run_length(rows=38, gbs=4, epochs=2, warmup=0.25).warmup == 5  # ceil(18 x 0.25 = 4.5)
    assert run_length(rows=None, gbs=4, steps=10, warmup=1.0).warmup == 1  # 1.0 is one step, not 100 %
    with pytest.raises(TrainError, match="--epochs: --data has 3 rows, fewer than one global batch \\(--gbs 4\\)"):
        run_length(rows=3, gbs=4, epochs=1)
    cfg = TrainConfig.from_flat({"resume": "x", "data": "synthetic", "epochs": 2, "gbs": 4, "warmup": 0.25})
    resolved = resolve(cfg, 38)
    assert (resolved.steps, resolved.optim.warmup, resolved.epochs) == (18, 5, None)
    assert resolve(resolved, 38) == resolved
    with pytest.raises(TrainError, match="--epochs needs a finite --data"):
        resolve(cfg, None)
    with pytest.raises(TrainError, match="--warmup must be a step count \\(integer >= 0\\) or a fraction in \\(0, 1\\), "
                                         "got 2.5"):
        TrainConfig.from_flat({"resume": "x", "data": "synthetic", "warmup": 2.5})


def test_fraction_must_be_resolved_and_missing_extras_say_what_to_install(monkeypatch, tmp_path):
    from ckptconv.errors import ConversionError
    from ckptconv.training import lr_at
    from nxdtrain.config.options import OptimConfig
    from nxdtrain.metrics import require_tensorboard
    from nxdtrain.plot import plot_log

    with pytest.raises(ConversionError, match="--warmup 0.5 is a fraction of the run: resolve it first"):
        lr_at(1, OptimConfig(warmup=0.5), decay_steps=10)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(TrainError, match=r"^--tensorboard needs the tensorboard package: pip install 'ckptconv\[viz\]'$"):
        require_tensorboard()
    with pytest.raises(TrainError, match=r"^nxdtrain plot needs the matplotlib package: pip install 'ckptconv\[viz\]'$"):
        plot_log(tmp_path / "log.jsonl", tmp_path / "c.png")


def test_epochs_and_steps_are_exclusive(capsys):
    assert main(["run", "--resume", "x", "--data", "synthetic", "--epochs", "1", "--steps", "3"]) == 1
    assert capsys.readouterr().err == ("nxdtrain: error: flags: --epochs and --steps are exclusive (give one: epochs "
                                       "size the run from --data)\n")


def test_one_epoch_from_json_gz_parts_with_warmup_tensorboard_and_plot(tmp_path, corpus, nxd_model, reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nxdtrain.plot import plot_log

    log, board = tmp_path / "log.jsonl", tmp_path / "tb"
    argv = ["run", "--resume", str(nxd_model("mha", tp=1, pp=1)), "--data", str(corpus / "parts"), "--seq-len", "16",
            "--gbs", "4", "--epochs", "1", "--warmup", "0.01", "--lr", "1e-3", "--min-lr", "1e-4", "--precision", "fp32",
            "--no-shuffle", "--seed", "7", "--log-jsonl", str(log), "--tensorboard", str(board),
            "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--dist-timeout", str(DIST_TIMEOUT)]
    config = load_config(build_parser().parse_args(argv))
    assert spawn(run_worker, (config,), 1, timeout_s=WORLD_TIMEOUT, preload=PRELOAD) == 0
    records = read_log(log)
    # 38 rows // gbs 4 = 9 steps; warmup ceil(9 x 0.01) = 1 step; then cosine from 1e-3 to 1e-4 over steps 2..9
    expected_lr = [1e-3] + [1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (s - 1) / 8)) for s in range(2, 10)]
    assert [r["step"] for r in records] == list(range(1, 10))
    assert [r["consumed_samples"] for r in records] == [4 * s for s in range(1, 10)]
    assert [r["lr"] for r in records] == pytest.approx(expected_lr, rel=1e-12)
    # the .json.gz parts hold the rows of rows.jsonl in the same order: the losses of transformers on those
    ref_losses, _ = reference("mha", data=str(corpus / "rows.jsonl"), seq_len=16, gbs=4, steps=9, warmup=1, lr=1e-3,
                              min_lr=1e-4, shuffle=False, seed=7)
    assert max(abs(r["loss"] - ref) for r, ref in zip(records, ref_losses, strict=True)) <= 1e-5

    events = EventAccumulator(str(board))
    events.Reload()
    for field in ("loss", "lr", "grad_norm", "tokens_per_s", "consumed_samples"):
        scalars = events.Scalars(f"train/{field}")
        assert [s.step for s in scalars] == list(range(1, 10))
        assert [s.value for s in scalars] == pytest.approx([r[field] for r in records], rel=1e-6), field

    figure = plot_log(log, tmp_path / "curves.png")
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    drawn = {ax.get_ylabel(): ax.get_lines()[0] for ax in figure.axes}
    assert list(drawn) == ["loss", "learning rate", "tokens/s"]
    for label, field in (("loss", "loss"), ("learning rate", "lr"), ("tokens/s", "tokens_per_s")):
        assert list(drawn[label].get_xdata()) == list(range(1, 10))
        assert list(drawn[label].get_ydata()) == [r[field] for r in records]


def test_plot_command_and_resumed_logs(tmp_path, capsys):
    lines = [{"step": s, "loss": 5.0 - s, "lr": 0.1 * s, "grad_norm": 1.0, "tokens_per_s": 100.0 + s,
              "consumed_samples": 4 * s} for s in (1, 2, 3)]
    lines += [{**lines[2], "loss": 9.0}, {**lines[2], "step": 4, "loss": 0.5}]  # a resumed run logged step 3 again
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["plot", str(tmp_path / "log.jsonl"), "-o", str(tmp_path / "out" / "c.png")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'out' / 'c.png'}\n"
    assert (tmp_path / "out" / "c.png").read_bytes()[:4] == b"\x89PNG"
    from nxdtrain.plot import read_log as read_plot_log

    assert [(r["step"], r["loss"]) for r in read_plot_log(tmp_path / "log.jsonl")] == [(1, 4.0), (2, 3.0), (3, 9.0),
                                                                                       (4, 0.5)]
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\nnot json\n')
    assert main(["plot", str(tmp_path / "bad.jsonl")]) == 1
    assert capsys.readouterr().err == ("nxdtrain: error: " + str(tmp_path / "bad.jsonl") +
                                       ": line 2 is not a step record of nxdtrain's --log-jsonl\n")
