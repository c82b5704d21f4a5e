"""A resume keeps the run (issue 21): the schedule and data order a tag recorded are reused or the resume is
refused; --override-schedule says what changed; a converted dir is never a --checkpoint-dir (the requeue trap)."""

from __future__ import annotations

import shutil

import pytest

from nxdtrain.checkpoint.continuity import check_resume, recorded_run
from nxdtrain.checkpoint.resume import resolve_resume
from nxdtrain.config import TrainConfig
from nxdtrain.errors import TrainError
from nxdtrain.train import prepare
from tests.nxdtrain.harness import run_world, train_options


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, nxd_model):
    """A converted tiny model and a checkpoint dir holding the step-2 tag of a 4-step cosine run."""
    root = tmp_path_factory.mktemp("continuity")
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    options = train_options(steps=4, warmup=1, checkpoint_freq=2)
    run_world(1, resume=str(src), checkpoint_dir=str(root / "ck"), log_jsonl=str(root / "a.jsonl"),
              **{**options, "steps": 2, "decay_steps": 4})
    return src, root / "ck", options


def test_a_resume_with_changed_steps_is_refused(two_steps):
    """The issue's case: --steps 8 on resume would move the decay end from step 4 to 8 (the lr jumps)."""
    _, ck, options = two_steps
    config = TrainConfig.from_flat({**options, "steps": 8, "resume": str(ck), "checkpoint_dir": str(ck)})
    with pytest.raises(TrainError) as info:
        prepare(config, world_size=1)
    assert str(info.value) == (f"--resume: this run changes what {ck}/step_2 recorded: decay steps 4 -> 8; resume "
                               "with the recorded values (--decay-steps (default: --steps)), or pass "
                               "--override-schedule to change the run on purpose")
    # The recorded schedule itself resumes (decay steps given, more steps): nothing changes, nothing refused.
    same = TrainConfig.from_flat({**options, "steps": 8, "decay_steps": 4, "resume": str(ck), "checkpoint_dir": str(ck)})
    assert not [n for n in prepare(same, world_size=1).resume_notes if "override" in n]


def test_override_schedule_says_exactly_what_changed(two_steps):
    _, ck, options = two_steps
    config = TrainConfig.from_flat({**options, "steps": 8, "lr": 2e-3, "seed": 8, "override_schedule": True,
                                    "resume": str(ck), "checkpoint_dir": str(ck)})
    notes = prepare(config, world_size=1).resume_notes
    assert ("--override-schedule: the run changes at this resume: peak lr 0.001 -> 0.002; decay steps 4 -> 8; "
            "seed 7 -> 8") in notes


def test_the_data_order_is_part_of_the_record(two_steps):
    _, ck, options = two_steps
    config = TrainConfig.from_flat({**options, "shuffle": False, "decay_steps": 4, "resume": str(ck),
                                    "checkpoint_dir": str(ck)})
    with pytest.raises(TrainError, match=r"recorded: shuffle True -> False; resume with the recorded values "
                                         r"\(--shuffle/--no-shuffle\)"):
        prepare(config, world_size=1)


def test_an_older_tag_says_what_is_assumed():
    old_scheduler = {"schedule": "cosine", "lr": 1e-3, "min_lr": 1e-4, "warmup": 1, "decay_steps": 4}
    run, missing = recorded_run({"options": {}}, old_scheduler)
    assert missing == ["seed", "shuffle"]
    new = {**old_scheduler, "seed": 7, "shuffle": True, "epochs": None}
    assert check_resume(run, missing, new, tag="T", override=False) == [
        "T records no seed, shuffle (an older tag): assuming this run's (seed 7, shuffle True)"]


def test_the_requeue_trap_is_refused(two_steps, tmp_path):
    """--checkpoint-dir equal to the converted input: refused; a dir that already fell into it resumes its tags."""
    src, ck, options = two_steps
    config = TrainConfig.from_flat({**options, "resume": str(src), "checkpoint_dir": str(src)})
    with pytest.raises(TrainError) as info:
        prepare(config, world_size=1)
    assert str(info.value) == (f"--checkpoint-dir {src}: holds NxD shards (model/: a converted checkpoint or a tag); "
                               f"tags written there would sit behind those shards, and a requeued --resume {src} "
                               f"would start again from them at step 0: use a directory of its own, e.g. {src}-run")
    trap = tmp_path / "trap"  # what an older nxdtrain left: converted shards and the run's tags in one dir
    shutil.copytree(src, trap)
    shutil.copytree(ck / "step_2", trap / "step_2")
    source = resolve_resume(str(trap), weights_only=False)
    assert source.full and source.root == trap / "step_2"
    assert source.case == (f"full state from tag {trap}/step_2 (the newest completed tag in {trap}; its converted "
                           "shards are where the run began)")
