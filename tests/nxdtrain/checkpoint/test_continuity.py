"""A resume keeps the run (issue 21): the schedule and data order a tag recorded are reused or the resume is
refused; --override-schedule says what changed; a converted dir is never a --checkpoint-dir (the requeue trap)."""

from __future__ import annotations

import shutil

import pytest

from nxdtrain.checkpoint.continuity import check_resume, recorded_run
from nxdtrain.checkpoint.resume import resolve_resume
from nxdtrain.config.options import TrainConfig
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


def test_an_optimizer_flag_that_differs_from_the_tag_is_refused_naming_both(two_steps, tmp_path):
    """A resume loads AdamW's hyper-parameters from the tag's param groups: an explicit --weight-decay (--beta1,
    --beta2, --eps) that differs was silently ignored; it is refused naming both values, and with
    --override-schedule it applies (said), the norm weights' zero weight decay kept."""
    _, ck, options = two_steps  # weight decay 0.1, betas (0.9, 0.95), eps 1e-8
    run = {**{k: v for k, v in options.items() if k != "checkpoint_freq"}, "resume": str(ck / "step_2"),
           "log_jsonl": str(tmp_path / "a.jsonl")}
    with pytest.raises(AssertionError, match="exited with"):  # refused in the worker, before any step
        run_world(1, **{**run, "weight_decay": 0.2, "eps": 1e-6})
    assert not (tmp_path / "a.jsonl").exists()
    same = run_world(1, **{**run, "log_jsonl": str(tmp_path / "same.jsonl")})
    changed = run_world(1, **{**run, "weight_decay": 0.2, "override_schedule": True,
                              "log_jsonl": str(tmp_path / "changed.jsonl")})
    assert same[0]["loss"] == changed[0]["loss"] and same[1]["loss"] != changed[1]["loss"]


def test_optimizer_groups_values():
    from nxdtrain.checkpoint.continuity import optimizer_groups
    from nxdtrain.config.options import OptimConfig

    groups = [{"weight_decay": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "lr": 1.0},
              {"weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8, "lr": 1.0}]
    optim = OptimConfig(weight_decay=0.1, beta2=0.99, eps=1e-8)
    # not given: the tag's groups, whatever the defaults say
    assert optimizer_groups(groups, OptimConfig(), frozenset(), tag="T", override=False) == (groups, [])
    assert optimizer_groups(groups, optim, frozenset({"eps"}), tag="T", override=False) == (groups, [])  # same
    with pytest.raises(TrainError) as info:
        optimizer_groups(groups, optim, frozenset({"weight_decay", "beta2", "eps"}), tag="T", override=False)
    assert str(info.value) == ("--resume: --weight-decay 0.1 (T records 0.01); --beta2 0.99 (T records 0.95): the "
                               "tag's AdamW param groups would be loaded over the flag; drop --weight-decay, --beta2 "
                               "(or give the recorded value), or pass --override-schedule to change it on purpose")
    new, notes = optimizer_groups(groups, optim, frozenset({"weight_decay", "beta2"}), tag="T", override=True)
    assert new == [{"weight_decay": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "lr": 1.0},
                   {"weight_decay": 0.0, "betas": (0.9, 0.99), "eps": 1e-8, "lr": 1.0}]
    assert notes == ["--override-schedule: AdamW changes at this resume: --weight-decay 0.1 (T records 0.01); "
                     "--beta2 0.99 (T records 0.95)"]


def test_a_tag_from_torchtitan_names_its_origin_and_says_numbers_without_noise(two_steps, tmp_path):
    """An nxdtrain tag through TorchTitan's DCP and back (from-dcp --to nxd): its scheduler.pt says it came from
    TorchTitan, whose DCP holds no schedule; the resume says so (not "an older tag"), and the min lr it assumes is
    0.0003, not 0.00030000000000000003 (3e-3 x 0.1 in binary)."""
    import torch

    import ckptconv

    _, ck, options = two_steps
    quiet = ckptconv.RunOptions(quiet=True)
    ckptconv.to_dcp(ck / "step_2", tmp_path / "dcp", options=quiet)
    ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "tag", to="nxd", config=ck / "step_2" / "hf" / "config.json",
                      consumed_samples=8, options=quiet)
    assert torch.load(tmp_path / "tag" / "scheduler.pt", weights_only=True)["from"] == "torchtitan"
    min_lr = 3e-3 * 0.1
    assert str(min_lr) == "0.00030000000000000003"
    config = TrainConfig.from_flat({**options, "min_lr": min_lr, "resume": str(tmp_path / "tag"),
                                    "checkpoint_dir": str(tmp_path / "ck")})
    notes = [n for n in prepare(config, world_size=1).resume_notes if "records no" in n]
    assert notes == [f"{tmp_path / 'tag'} records no schedule, min lr, warmup steps, decay steps, seed, shuffle (from "
                     "TorchTitan's DCP, which holds no schedule): assuming this run's (schedule cosine, min lr 0.0003, "
                     "warmup steps 1, decay steps 4, seed 7, shuffle True)"]


def test_changed_numbers_are_said_without_binary_noise():
    old = {"schedule": "cosine", "lr": 1e-3, "min_lr": 1e-4, "warmup": 1, "decay_steps": 4, "seed": 7, "shuffle": True}
    notes = check_resume(old, [], {**old, "min_lr": 3e-3 * 0.1}, tag="T", override=True)
    assert notes == ["--override-schedule: the run changes at this resume: min lr 0.0001 -> 0.0003"]
