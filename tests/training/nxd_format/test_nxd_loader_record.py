"""NxD's own loader resumed the tags our NxD-format writer writes: the record, and that it still holds.

``fixtures/nxdt-official/written_by_ckptconv.json`` records, per fixture case, the ckptconv command that rewrote the
case's tag in NxD's optimizer format, the content of what it wrote (key tree, dtypes, shapes, a sha256 of every
tensor's values) and what NxD 2.28's ``load_checkpoint`` then did with it on XLA:CPU (``tools/nxd_check``: both
resume ways, step 3 with the case's recorded gradients, compared with the uninterrupted run).

That run needs NxD's source and torch-xla, which this lane lacks. So this lane re-runs each command with the
CURRENT writer and checks that it writes the same content NxD's loader was shown; any change to the writer's output
fails here until the proof is rerun.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptconv.cli.main import main as ckptconv
from ckptconv.io.safe_load import load_small
from tests.torch_rows import first_difference, placeholder_paths, tag_tree

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "nxdt-official"
RECORD = json.loads((FIXTURES / "written_by_ckptconv.json").read_text())
RERUN = (
    "writer output changed since NxD's loader checked it: rerun tools/nxd_check "
    "(NXD_SRC=<neuronx-distributed v2.28.0> .venv-xla/bin/python -m tools.nxd_check prove "
    "--ckptconv .venv/bin/ckptconv --nxdtrain .venv/bin/nxdtrain --out-root <a new folder> --writer-repo .; "
    "see fixtures/nxdt-official/README.md)"
)


def write(case: str, out: Path) -> Path:
    """Run the recorded command with the current writer; the written tag directory."""
    entry = RECORD["cases"][case]
    args = [part.format(case=FIXTURES / case, out=out) for part in entry["command"][1:]]
    assert ckptconv(args) == 0
    return out / entry["tag"]


def test_every_fixture_case_was_proved() -> None:
    cases = sorted(p.name for p in FIXTURES.iterdir() if (p / "case.json").is_file())
    assert sorted(RECORD["cases"]) == cases


@pytest.mark.parametrize("case", sorted(RECORD["cases"]))
def test_writer_still_writes_what_nxds_loader_resumed(case: str, tmp_path: Path) -> None:
    tag = write(case, tmp_path)
    difference = first_difference(tag_tree(tag), RECORD["cases"][case]["files"])
    assert difference is None, f"{RERUN}\n{case}: {difference}"


@pytest.mark.parametrize("case", sorted(RECORD["cases"]))
def test_nxd_resumed_it_as_the_uninterrupted_run(case: str) -> None:
    """What the record says NxD did, against the case's own manifest: loaded both ways, step and lr of step 3
    restored (and the scheduler's next rate, where the scheduler is restored), and step 3 equal to the
    uninterrupted run bit for bit, except where the source holds no fp32 masters (a bf16 ZeRO-1 run saved
    without them: no file can carry them; there it equals NxD's own resume where the case recorded that)."""
    manifest = json.loads((FIXTURES / case / "case.json").read_text())
    flags = manifest["flags"]
    masters_lost = flags["zero1"] and flags["model_dtype"] == "bfloat16" and not flags["use_master_weights_in_ckpt"]
    for way, outcome in RECORD["cases"][case]["nxd_resume"].items():
        assert outcome["load"] == "ok", (way, outcome.get("error"))
        assert outcome["optimizer_steps_after_load"] == [float(manifest["saved_after_step"])], way
        assert outcome["lr_after_load"] == manifest["steps"][2]["lr"], way
        if outcome["scheduler_restored"]:  # case.json's param_groups hold the uninterrupted run's rates after step 3
            assert outcome["lr_after_next"] == [g["lr"] for g in manifest["param_groups"]], way
        if not masters_lost:
            assert outcome["masters_equal_save_after_load"] and outcome["after_next_max_abs_diff"] == 0.0, way
        elif "after_next_max_abs_diff_vs_nxd_resumed" in outcome:
            assert outcome["after_next_max_abs_diff_vs_nxd_resumed"] == 0.0, way


def test_nxd_resumed_the_tags_nxdtrain_trained() -> None:
    """nxdtrain's own NxD-format saves (trained from a fixture tag): NxD loaded each both ways with the tag's exact
    values, step and next rate, and its next step matches one eager AdamW step from the tag's state within XLA:CPU's
    rounding (1e-7; NxD's own uninterrupted fixture steps are 7.5e-9 from the same eager step)."""
    trained = RECORD["trained_by_nxdtrain"]
    assert sorted(trained) == [
        "nxdtrain_from_plain_fp32",
        "nxdtrain_from_zero1_bf16_masters",
        "nxdtrain_from_zero1_fp32",
    ]
    for name, entry in trained.items():
        for way, outcome in entry["nxd_resume"].items():
            assert outcome["load"] == "ok", (name, way, outcome.get("error"))
            assert outcome["masters_equal_save_after_load"], (name, way)
            assert outcome["optimizer_steps_after_load"] == [float(entry["reference"]["next_step"] - 1)], (name, way)
            assert outcome["lr_after_load"] == [entry["reference"]["next_lr"]] * 2, (name, way)
            assert outcome["after_next_max_abs_diff"] < 1e-7, (name, way)


def test_a_changed_value_is_named(tmp_path: Path) -> None:
    """One moment element changed in the written optimizer file: the comparison names the file and the key."""
    tag = write("plain_fp32", tmp_path)
    optim = tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    state = load_small(optim)
    state["state"][3]["exp_avg"].view(-1)[5] += 1e-6
    torch.save(state, optim)
    difference = first_difference(tag_tree(tag), RECORD["cases"]["plain_fp32"]["files"])
    assert difference is not None and difference.startswith(
        "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt key ['state', 3, 'exp_avg']"
    ), difference


LIGHTNING = RECORD["resumed_by_lightning"]
RERUN_LIGHTNING = RERUN.replace("prove --ckptconv", "lightning --ckptconv").replace("--nxdtrain .venv/bin/nxdtrain ", "")


@pytest.mark.parametrize("case", sorted(LIGHTNING["cases"]))
def test_writer_still_writes_what_lightning_resumed(case: str, tmp_path: Path) -> None:
    """The --nxd-trainer nxdt rewrites lightning resumed: the current writer writes the same content (OUT's path,
    which NxDT's callback state holds, as {out})."""
    entry = LIGHTNING["cases"][case]
    args = [part.format(case=FIXTURES / case, out=tmp_path) for part in entry["command"][1:]]
    assert ckptconv(args) == 0
    tag = tmp_path / entry["tag"]
    difference = first_difference(placeholder_paths(tag_tree(tag), tmp_path), entry["files"])
    assert difference is None, f"{RERUN_LIGHTNING}\n{case}: {difference}"


@pytest.mark.parametrize("case", ["harness_on_nxdts_own_tag", *sorted(LIGHTNING["cases"])])
def test_lightning_resumed_it_as_the_uninterrupted_run(case: str) -> None:
    """What lightning 2.5.0's own restore did (NxDT's way): global_step, the fit loop's counters, the scheduler and
    AdamW's step at 2, the optimizer's values those at the save, then step 3 equal to the uninterrupted run bit for
    bit with the uninterrupted rate after it; our tags' checkpoint-callback state restored (NxDT's key)."""
    name = "nxdt_zero1_bf16_masters_xser" if case == "harness_on_nxdts_own_tag" else case
    outcome = LIGHTNING[case] if case == "harness_on_nxdts_own_tag" else LIGHTNING["cases"][case]["lightning_resume"]
    manifest = json.loads((FIXTURES / name / "case.json").read_text())
    assert outcome["load"] == "ok", outcome.get("error")
    assert outcome["progress_after_load"] == {"global_step": 2, "current_epoch": 0, "optimizer_steps": 2,
                                              "batches_completed": 1, "batches_that_stepped": 1, "scheduler_steps": 2}
    assert outcome["scheduler_last_epoch_after_load"] == 2 and outcome["optimizer_steps_after_load"] == [2.0]
    assert outcome["lr_after_load"] == manifest["steps"][2]["lr"] == outcome["scheduler_last_lr_after_load"]
    assert outcome["masters_equal_save_after_load"] and outcome["after_next_max_abs_diff"] == 0.0
    assert outcome["lr_after_next"] == [g["lr"] for g in manifest["param_groups"]]
    assert outcome["progress_after_next"]["global_step"] == 3 and outcome["scheduler_last_epoch_after_next"] == 3
    callback = outcome["callback_restored"]
    if callback["class"] == "NeMoModelCheckpoint":  # ours, in the directory lightning's callback watches
        assert callback["best_model_score"] == 2.0 and callback["best_model_path"].endswith(LIGHTNING["cases"][case]["tag"])


@pytest.mark.parametrize("case", sorted(LIGHTNING["trained_by_nxdtrain"]))
def test_lightning_resumed_the_tags_nxdtrain_trained(case: str) -> None:
    """nxdtrain's NxD-format save at step 4 (trained from a fixture tag), rewritten as NxDT's: lightning restored
    step 4 (global_step, loops, scheduler, AdamW's step, the tag's exact values, our callback state), and step 5
    matches one eager AdamW step from the tag's state within XLA:CPU's rounding (as NxD's loader did, above)."""
    outcome = LIGHTNING["trained_by_nxdtrain"][case]["lightning_resume"]
    assert outcome["load"] == "ok", outcome.get("error")
    assert outcome["progress_after_load"] == {"global_step": 4, "current_epoch": 0, "optimizer_steps": 4,
                                              "batches_completed": 3, "batches_that_stepped": 3, "scheduler_steps": 4}
    assert outcome["scheduler_last_epoch_after_load"] == 4 and outcome["optimizer_steps_after_load"] == [4.0]
    assert outcome["masters_equal_save_after_load"] and outcome["after_next_max_abs_diff"] < 1e-7
    trained = RECORD["trained_by_nxdtrain"][f"nxdtrain_from_{case}"]
    assert outcome["lr_after_load"] == [trained["reference"]["next_lr"]] * 2 == outcome["scheduler_last_lr_after_load"]
    assert outcome["callback_restored"]["best_model_score"] == 4.0
    assert outcome["progress_after_next"]["global_step"] == 5 and outcome["scheduler_last_epoch_after_next"] == 5
