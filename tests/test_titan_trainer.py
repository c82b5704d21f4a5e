"""The TorchTitan lane: TorchTitan 0.3.0's own trainer (``torchtitan.train``'s ``Trainer``, built from the
``continue_run()`` of ``OUT/torchtitan_config.py``, and its ``train()`` loop: its checkpoint load, loss, gradient
clipping, AdamW and lr scheduler) continues NxD's and NxDT's own training tags as nxdtrain continues them.

One process on gloo with the environment torchrun sets; the CPU shims are ``tests/titan_shims.py``'s (listed in
docs/torchtitan.md). Runs in ``.venv-titan``; the main lane skips it."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")

import ckptconv  # noqa: E402
from ckptconv.engine.options import RunOptions  # noqa: E402
from ckptconv.titan.state import ScheduleFlags  # noqa: E402
from nxdtrain.config.options import TrainConfig  # noqa: E402
from nxdtrain.data.rows import global_batches  # noqa: E402
from tests.nxdtrain.checkpoint.test_nxd_resume import nxd_tag, nxdtrain_run  # noqa: E402
from tests.titan_shims import cpu_device, generated_config, rows_dataloader, rows_tokenizer, sdpa_attention  # noqa: E402

DATA = dict(data="synthetic", seq_len=16, gbs=4, mbs=1, seed=7)  # both trainers take these rows
SAVED_STEP, LAST_STEP = 2, 4  # the tags were saved at step 2; steps 3 and 4 continue them
# the fixture case: the schedule it ran (nxdtrain's flags), and whether its tag records it (NxDT's does not:
# to-dcp takes the flags too)
CASES = {
    "zero1_bf16_masters": (dict(schedule="CosineAnnealing", lr=0.01, min_lr=0.001, warmup=2, decay_steps=10), True),
    "nxdt_zero1_bf16_masters_xser": (dict(schedule="LinearAnnealingWithWarmUp", lr=0.01, warmup=2, decay_steps=10),
                                     False),
}


def flag_argv(flags: dict) -> list[str]:
    return [arg for key, value in flags.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


def nxdtrain_losses(tag: Path, flags: dict, log: Path) -> list[tuple[float, float]]:
    """nxdtrain's own continuation of ``tag`` to LAST_STEP (nxdtrain_run: --data synthetic --seq-len 16 --gbs 4
    --mbs 1, the DATA rows); its logged (loss, lr) per step."""
    done = nxdtrain_run(tag, log, *flag_argv(flags), "--precision", "fp32", "--seed", str(DATA["seed"]),
                        "--nproc", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 4] and [r["consumed_samples"] for r in records] == [12, 16]
    return [(r["loss"], r["lr"]) for r in records]


def torchrun_env(monkeypatch) -> None:
    """What torchrun sets for one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)


def titan_losses(out: Path, rows: list[torch.Tensor], dump: Path, monkeypatch) -> list[tuple[float, float]]:
    """TorchTitan's ``Trainer`` of OUT's ``continue_run()`` trains to LAST_STEP on ``rows``; its logged (loss, lr)
    per step."""
    module = generated_config(out)
    # the SET names a user sets: the rows' batch and length, fp32 compute, where TorchTitan saves
    monkeypatch.setattr(module, "LOCAL_BATCH_SIZE", DATA["gbs"])
    monkeypatch.setattr(module, "SEQ_LEN", DATA["seq_len"])
    monkeypatch.setattr(module, "STEPS", LAST_STEP)
    monkeypatch.setattr(module, "MIXED_PRECISION_PARAM", "float32")
    monkeypatch.setattr(module, "DUMP_FOLDER", str(dump))
    config = module.continue_run()
    assert config.checkpoint.initial_load_path == str(out.resolve())
    assert config.checkpoint.initial_load_model_only is False
    # the CPU shims (tests/titan_shims.py)
    sdpa_attention(config.model_spec.model)
    config.tokenizer = rows_tokenizer()
    config.dataloader = rows_dataloader(rows)
    config.training.disable_cuda_graphs = True
    config.metrics.log_freq = 1  # log (and so compute) every step's loss
    cpu_device(monkeypatch)
    torchrun_env(monkeypatch)

    import torch.distributed as dist

    trainer = config.build()
    losses: list[tuple[int, float, float]] = []
    log = trainer.metrics_processor.log

    def record(step, global_avg_loss, *args, **kwargs):
        lrs = {v for k, v in kwargs["extra_metrics"].items() if k.startswith("lr/")}  # one per param group
        assert len(lrs) == 1, kwargs["extra_metrics"]
        losses.append((step, global_avg_loss, lrs.pop()))
        return log(step, global_avg_loss, *args, **kwargs)

    monkeypatch.setattr(trainer.metrics_processor, "log", record)
    try:
        trainer.train()
        assert trainer.step == LAST_STEP
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert [step for step, _, _ in losses] == [3, 4], losses
    return [(loss, lr) for _, loss, lr in losses]


@pytest.mark.parametrize("case", list(CASES))
def test_titans_own_trainer_continues_nxds_tag_as_nxdtrain_does(case, tmp_path, monkeypatch):
    """to-dcp of NxD's (NxDT's) own step-2 tag; ``torchtitan.train``'s Trainer from the generated config loads it
    (model from the fp32 masters, AdamW state, schedule, step) and its ``train()`` runs steps 3-4 on nxdtrain's
    rows: the losses are nxdtrain's own continuation's within 1e-5."""
    flags, recorded = CASES[case]
    tag = nxd_tag(case, tmp_path / "src")
    want = nxdtrain_losses(tag, flags, tmp_path / "nxdtrain.jsonl")
    schedule = None if recorded else ScheduleFlags(**flags)
    ckptconv.to_dcp(tag, tmp_path / "dcp", schedule=schedule, options=RunOptions(quiet=True))
    cfg = TrainConfig.from_flat({**DATA, "steps": LAST_STEP, "resume": "unused", "no_checkpoint": True})
    vocab = json.loads((tag / "hf" / "config.json").read_text())["vocab_size"]
    rows = global_batches(cfg, vocab, start=SAVED_STEP)  # samples 8-15: where nxdtrain continued the tag's data
    got = titan_losses(tmp_path / "dcp", rows, tmp_path / "titan", monkeypatch)
    for (loss, lr), (nxd_loss, nxd_lr) in zip(got, want, strict=True):  # measured: equal (fp32, same rows)
        assert loss == pytest.approx(nxd_loss, abs=1e-5, rel=0), (got, want)
        assert lr == pytest.approx(nxd_lr, rel=1e-12), (got, want)  # step 3 at the peak, step 4 decayed
    assert got[0][1] != got[1][1]
    # TorchTitan saved its last step as a full checkpoint in its own folder
    assert (tmp_path / "titan" / "checkpoint" / f"step-{LAST_STEP}" / ".metadata").is_file()
