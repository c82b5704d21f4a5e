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

from ckptconv.cli import main as ckptconv
from ckptconv.io.safe_load import load_small
from tests.torch_rows import first_difference, tag_tree

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nxdt-official"
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
