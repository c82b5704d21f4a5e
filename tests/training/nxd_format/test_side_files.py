"""``ckptconv reshard --optimizer-format nxd --nxd-trainer nxdt``: NxDT's side files, compared with what NxD 2.28
and lightning 2.5.0 wrote in ``fixtures/nxdt-official/`` (the NxDT case's ``user_content.pt``, the NxD example
cases' ``scheduler.pt``), and the refusals. nxdtrain's own tags (and their resume) are in
``tests/nxdtrain/checkpoint/test_nxdt_trainer_files.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.commands.api import RunOptions, reshard
from ckptconv.errors import ConversionError
from ckptconv.training.nxd_format.side_files import (
    CHECKPOINT_CALLBACK,
    LINEAR,
    NXD_EXAMPLE,
    NXDT,
    consumed_text,
    nxdt_content,
    scheduler_state,
)
from tests.torch_rows import rows

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "nxdt-official"
NXDT_CASE = FIXTURES / "nxdt_zero1_bf16_masters_xser"
NXDT_TAG = NXDT_CASE / "ckpt" / "hf_llama--step=2-consumed_samples=8.0.ckpt"
EXAMPLE_CASE = FIXTURES / "zero1_fp32"
NAME = "hf_llama--step=2-consumed_samples=8.0.ckpt"


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def _as_ours(content: dict[str, Any]) -> dict[str, Any]:
    """The fixture's callback key under NxDT's class name: the fixture's lightning run used lightning's own
    ModelCheckpoint (NeMo absent), NxDT registers NeMoModelCheckpoint with the same settings and state."""
    (key, state), = content["callbacks"].items()
    assert key.startswith("ModelCheckpoint{")
    return {**content, "callbacks": {CHECKPOINT_CALLBACK + key.removeprefix("ModelCheckpoint"): state}}


def _rewrite(src: Path, out: Path, case: Path, **kwargs: Any) -> Any:
    return reshard(src, out, tp=1, pp=1, optimizer_format="nxd", zero1=True, config=case / "hf/config.json",
                   options=RunOptions(quiet=True), **kwargs)


def test_nxdt_tag_rewritten_keeps_its_user_content(tmp_path: Path) -> None:
    """NxDT's tag as NxDT's (given and by default): its user_content back, every key and value; no scheduler.pt."""
    want = rows(_load(NXDT_TAG / "user_content.pt"), digests=True)
    for trainer in (NXDT, None):
        out = tmp_path / str(trainer) / NAME
        _rewrite(NXDT_TAG, out, NXDT_CASE, nxd_trainer=trainer)
        assert rows(_load(out / "user_content.pt"), digests=True) == want
        assert not (out / "scheduler.pt").exists()


def test_generated_content_is_lightnings() -> None:
    """The dict built from the NxDT case's position (step 2, LinearAnnealingWithWarmUp warmup 2 / max 10 at
    lr 0.01, the tag's path) equals what lightning 2.5.0 saved there, key order and values, the callback's
    class name aside (see _as_ours)."""
    fixture = _load(NXDT_TAG / "user_content.pt")
    record = {"schedule": LINEAR, "lr": 0.01, "min_lr": None, "warmup": 2, "decay_steps": 10}
    out = Path(fixture["callbacks"][next(iter(fixture["callbacks"]))]["best_model_path"])
    ours = nxdt_content(out, 2, scheduler_state(record, 2, 2, NXDT), every_n_train_steps=2)
    assert rows(ours, digests=True) == rows(_as_ours(fixture), digests=True)
    assert list(ours["lr_schedulers"][0]) == list(fixture["lr_schedulers"][0])


@pytest.mark.parametrize("step", [1, 2, 3, 9, 10, 11])
def test_linear_scheduler_state_is_torchs_lambdalr(step: int) -> None:
    """NxDT's LinearAnnealingWithWarmUp state at any step (warmup, decay, past the end) equals torch's LambdaLR
    over transformers' linear lambda stepped as lightning steps it."""
    from transformers.optimization import get_linear_schedule_with_warmup

    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(2)]  # NxD's two groups
    optimizer = torch.optim.AdamW(groups, lr=0.03)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=10)
    for _ in range(step):
        optimizer.step()
        scheduler.step()
    record = {"schedule": LINEAR, "lr": 0.03, "min_lr": None, "warmup": 3, "decay_steps": 10}
    theirs = scheduler.state_dict()
    ours = scheduler_state(record, step, 2, NXDT)
    assert ours == theirs and list(ours) == list(theirs)


def test_cosine_scheduler_state_is_nxds() -> None:
    """CosineAnnealing (NxD's example and NeMo's, the one NxDT uses) at step 2: NxD's own scheduler.pt."""
    record = {"schedule": "CosineAnnealing", "lr": 0.01, "min_lr": 0.001, "warmup": 2, "decay_steps": 10}
    want = _load(EXAMPLE_CASE / "ckpt/step_2/scheduler.pt")
    for trainer in (NXD_EXAMPLE, NXDT):
        state = scheduler_state(record, 2, 2, trainer)
        assert state == want and list(state) == list(want)


def test_nxd_example_tag_as_nxdt(tmp_path: Path) -> None:
    """NxD's example tag written as NxDT's: the NxDT case's key tree, step 2's loops as lightning saved them,
    NxD's CosineAnnealing state as lr_schedulers[0], the callback on OUT; consumed samples from OUT's name."""
    out = tmp_path / "run" / NAME
    _rewrite(EXAMPLE_CASE / "ckpt/step_2", out, EXAMPLE_CASE, nxd_trainer=NXDT)
    fixture = _as_ours(_load(NXDT_TAG / "user_content.pt"))
    got = _load(out / "user_content.pt")
    assert [r[0] for r in rows(got) if r[0][0] != "lr_schedulers" and r[0][:1] != ["callbacks"]] == \
        [r[0] for r in rows(fixture) if r[0][0] != "lr_schedulers" and r[0][:1] != ["callbacks"]]
    assert list(got) == list(fixture) and list(got["callbacks"]) == list(fixture["callbacks"])
    assert {k: v for k, v in got.items() if k not in ("callbacks", "lr_schedulers")} == \
        {k: v for k, v in fixture.items() if k not in ("callbacks", "lr_schedulers")}
    assert got["lr_schedulers"] == [_load(EXAMPLE_CASE / "ckpt/step_2/scheduler.pt")]
    (state,) = got["callbacks"].values()
    assert state["best_model_path"] == str(out.absolute()) and state["dirpath"] == str(out.absolute().parent)
    assert int(state["best_model_score"]) == 2 and state["best_model_score"].dtype == torch.int64
    assert not (out / "scheduler.pt").exists()


def test_nxdt_tag_as_nxd_example_needs_cosine(tmp_path: Path) -> None:
    """NxDT's LinearAnnealingWithWarmUp has no counterpart in NxD's examples: refused by name, nothing written."""
    out = tmp_path / "step_2"
    with pytest.raises(ConversionError, match="LinearAnnealingWithWarmUp: NxD's examples have no such scheduler"):
        _rewrite(NXDT_TAG, out, NXDT_CASE, nxd_trainer=NXD_EXAMPLE)
    assert not out.exists()


def test_names_refused_with_the_right_one(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match=r"for step 2 and 8 consumed samples: <name>--step=2-consumed_samples="
                                              r"8\.0\.ckpt"):
        _rewrite(NXDT_TAG, tmp_path / "step_2", NXDT_CASE, nxd_trainer=NXDT)
    with pytest.raises(ConversionError, match=r"for step 2 and 8 consumed samples: hf--step=2-consumed_samples=8\.0"):
        _rewrite(NXDT_TAG, tmp_path / "hf--step=2-consumed_samples=8.ckpt", NXDT_CASE)
    with pytest.raises(ConversionError, match=r"needs NxDT's tag name a--step=2-consumed_samples=<X>\.ckpt"):
        _rewrite(EXAMPLE_CASE / "ckpt/step_2", tmp_path / "a--step=3-consumed_samples=8.0.ckpt", EXAMPLE_CASE,
                 nxd_trainer=NXDT)
    with pytest.raises(ConversionError, match="consumed_samples='8' is not a sample count as lightning writes it"):
        _rewrite(EXAMPLE_CASE / "ckpt/step_2", tmp_path / "a--step=2-consumed_samples=8.ckpt", EXAMPLE_CASE,
                 nxd_trainer=NXDT)
    with pytest.raises(ConversionError, match="--nxd-trainer nxdt applies to --optimizer-format nxd only"):
        reshard(NXDT_TAG, tmp_path / NAME, tp=1, pp=1, nxd_trainer=NXDT, options=RunOptions(quiet=True))
    assert sorted(tmp_path.iterdir()) == []


def test_consumed_samples_as_lightning_formats_them() -> None:
    """Lightning formats the logged float (a float32 tensor) through ``format``: 2**24 + 1 samples read back as
    2**24 in NxDT's name, as NxDT's own run would write it."""
    for n in (0, 8, 1024000, 2**24 + 1):
        template = "{0[c]}"  # lightning's: the metric by name from the dict of candidates
        assert consumed_text(n) == template.format({"c": torch.tensor(float(n))})
    assert consumed_text(2**24 + 1) == "16777216.0"
