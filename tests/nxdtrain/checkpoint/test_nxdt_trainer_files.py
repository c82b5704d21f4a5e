"""nxdtrain's tag written as NxDT's (``ckptconv reshard --optimizer-format nxd --nxd-trainer nxdt``): lightning's
checkpoint dict with the NxDT fixture's keys and this run's values, and ``nxdtrain run --resume`` of it continues
with the uninterrupted run's losses (nxdtrain's own record under ``user_content.pt['nxdtrain']``).

References: the NxDT case of ``fixtures/nxdt-official`` (lightning 2.5.0's dict at step 2, same step as here),
torch's ``LambdaLR`` over transformers' linear lambda (NxDT's LinearAnnealingWithWarmUp), NxD's example
``scheduler.pt`` structure for CosineAnnealing, and the uninterrupted run's log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.commands.api import RunOptions, reshard
from ckptconv.errors import ConversionError
from tests.nxdtrain.harness import run_world, train_options
from tests.torch_rows import rows
from tests.training.nxd_format.test_side_files import NXDT_TAG, _as_ours

TOL = 1e-5
LAYOUT = dict(tp=1, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=1)
NAME = "run--step=2-consumed_samples=8.0.ckpt"  # 2 steps x --gbs 4


def _options(schedule: str) -> dict[str, Any]:
    return train_options(optimizer="adamw", steps=4, decay_steps=6, warmup=2, gbs=4, mbs=1, checkpoint_freq=2,
                         keep=2, schedule=schedule, lr=1e-3, min_lr=0.0 if schedule != "CosineAnnealing" else 1e-4,
                         optimizer_format="nxdtrain", precision="fp32")


def _lambda_lr_state(steps: int) -> dict[str, Any]:
    """torch's LambdaLR over transformers' linear lambda (warmup 2, max 6, lr 1e-3, NxD's two groups)."""
    from transformers.optimization import get_linear_schedule_with_warmup

    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(2)]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=6)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler.state_dict()


@pytest.mark.parametrize("schedule", ["LinearAnnealingWithWarmUp", "CosineAnnealing"])
def test_nxdtrain_tag_as_nxdt_resumes_exactly(schedule: str, nxd_model: Any, tmp_path: Path) -> None:
    src = nxd_model("gqa2-4", **LAYOUT)
    options = _options(schedule)
    straight = run_world(1, resume=str(src), checkpoint_dir=str(tmp_path / "ckpt"),
                         log_jsonl=str(tmp_path / "log.jsonl"), tp=1, pp=1, **options)
    out = tmp_path / "nxdt" / NAME
    reshard(tmp_path / "ckpt/step_2", out, tp=1, pp=1, optimizer_format="nxd", nxd_trainer="nxdt",
            options=RunOptions(quiet=True))
    assert not (out / "scheduler.pt").exists()
    user = torch.load(out / "user_content.pt", weights_only=True)
    ours = {k: v for k, v in user.items() if k != "nxdtrain"}
    fixture = _as_ours(torch.load(NXDT_TAG / "user_content.pt", weights_only=True))
    key_tree = [r[0] for r in rows(fixture) if r[0][:2] != ["callbacks", next(iter(fixture["callbacks"]))]
                and r[0][0] != "lr_schedulers"]
    assert [r[0] for r in rows(ours) if r[0][0] not in ("callbacks", "lr_schedulers")] == key_tree
    assert ours["global_step"] == 2 and ours["epoch"] == 0 and ours["loops"] == fixture["loops"]  # both at step 2
    (key,) = ours["callbacks"]
    assert "'every_n_train_steps': 2" in key  # the run's --checkpoint-freq
    (state,) = ours["lr_schedulers"]
    if schedule == "LinearAnnealingWithWarmUp":
        want = _lambda_lr_state(2)
        assert state == want and list(state) == list(want)
    else:
        assert list(state) == list(torch.load(Path(NXDT_TAG).parents[2] / "zero1_fp32/ckpt/step_2/scheduler.pt",
                                              weights_only=True))
        assert state["last_epoch"] == 2 and state["max_steps"] == 6 and state["min_lr"] == 1e-4
    assert state["_last_lr"][0] == straight[2]["lr"]  # the lr step 3 ran at
    assert user["nxdtrain"]["user_content"]["consumed_samples"] == 8
    resumed = run_world(1, resume=str(out), checkpoint_dir=str(tmp_path / "again"),
                        log_jsonl=str(tmp_path / "again.jsonl"), tp=1, pp=1, **options)
    assert [r["step"] for r in resumed] == [3, 4]
    for mine, theirs in zip(resumed, straight[2:], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=TOL), (mine, theirs)
        assert mine["lr"] == theirs["lr"]


def test_other_schedules_refused_by_name(nxd_model: Any, tmp_path: Path) -> None:
    src = nxd_model("gqa2-4", **LAYOUT)
    run_world(1, resume=str(src), checkpoint_dir=str(tmp_path / "ckpt"), log_jsonl=str(tmp_path / "log.jsonl"),
              tp=1, pp=1, **{**_options("linear"), "steps": 2, "min_lr": 1e-4})
    with pytest.raises(ConversionError, match="schedule 'linear': NxDT has no such scheduler.*needs a run trained "
                                              "with schedule CosineAnnealing or LinearAnnealingWithWarmUp"):
        reshard(tmp_path / "ckpt/step_2", tmp_path / "x" / NAME, tp=1, pp=1, optimizer_format="nxd",
                nxd_trainer="nxdt", options=RunOptions(quiet=True))
    assert not (tmp_path / "x").exists()
