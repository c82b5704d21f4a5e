"""The train job stopped after its first checkpoint and started again by Slurm: requeued by hand (scontrol requeue,
LAUNCHER=srun) and preempted by a job of a higher-priority partition (SIGTERM, GraceTime; LAUNCHER=torchrun). Each
later start resumes the newest completed tag, and every step's loss is that of an uninterrupted run."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import wait_until
from tests.slurm.cluster import (
    ENDED,
    POLL,
    completed_tags,
    completions,
    ended,
    job,
    losses,
    output,
    sbatch,
    slurm,
    wait_state,
)
from tests.slurm.conftest import STEPS, TRAIN_ARGS, template_env


def start_training(reference, tmp_path: Path, launcher: str) -> tuple[int, Path, Path]:
    """The train job from the reference's converted shards, once its first tag is complete: (job, CKPT, log)."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "train.jsonl"
    train = sbatch("train.sbatch", ["--nodes", "2"], tmp_path, (*TRAIN_ARGS, "--log-jsonl", str(log)),
                   **template_env(INIT=str(reference.nxd), CKPT=str(ckpt), LAUNCHER=launcher))
    wait_until(lambda: bool(completed_tags(ckpt)) or job(train)["JobState"] in ENDED, f"job {train}'s first tag", 300,
               poll=POLL)
    return train, ckpt, log


def stopped(train: int, ckpt: Path) -> list[str]:
    """Once Slurm has stopped the job and holds it pending again: its completed tags, none of them the last step's."""
    wait_state(train, {"PENDING"})
    tags = completed_tags(ckpt)
    assert tags and f"step_{STEPS}" not in tags, f"job {train} was not stopped mid-run: {tags}"
    return tags


def resumed(reference, train: int, ckpt: Path, log: Path, tags: list[str], cwd: Path) -> str:
    """Let the held job start (Slurm holds a requeued job two minutes), wait for its end, check the resume. Not at
    once: slurmd refuses to launch a job in the second its credential was revoked by the stop ('Job credential
    revoked', and the job ends FAILED), a race Slurm's own hold avoids."""
    slurm("scontrol", "update", f"JobId={train}", "StartTime=now+2")
    record = ended(train, timeout=600)
    text = output("train.sbatch", train, cwd).read_text()
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert job(train)["Restarts"] == "1"
    assert [r["JobState"] for r in completions(train)] == ["PENDING", "COMPLETED"]  # one record per start
    assert f"nxdtrain: resume: auto: full state from newest completed tag {tags[-1]} of {ckpt}" in text, text
    assert losses(log) == reference.losses
    assert completed_tags(ckpt)[-1] == f"step_{STEPS}"
    return text


def test_requeued_after_its_first_checkpoint_resumes_from_it(reference, tmp_path):
    train, ckpt, log = start_training(reference, tmp_path, "srun")
    slurm("scontrol", "requeue", str(train))
    tags = stopped(train, ckpt)
    text = resumed(reference, train, ckpt, log, tags, tmp_path)
    assert "DUE TO JOB REQUEUE" in text


def test_preempted_with_grace_time_requeues_itself_and_resumes(reference, tmp_path):
    """Preemption gives the tasks SIGTERM and GraceTime (20 s here) before SIGKILL; nxdtrain's ranks finish a save
    in progress, start none after it and stop at the same step (nxdtrain.parallel.preempt): every tag is complete;
    the job, being preempted, requeues itself instead of ending FAILED."""
    train, ckpt, log = start_training(reference, tmp_path, "torchrun")
    urgent = subprocess.run(["sbatch", "--parsable", "--partition", "urgent", "--nodes", "2", "--exclusive",
                             "--output", str(tmp_path / "urgent-%j.out"), "--wrap", "sleep 1"],
                            capture_output=True, text=True, timeout=60, check=True)
    tags = stopped(train, ckpt)
    text = output("train.sbatch", train, tmp_path).read_text()
    assert f"train.sbatch: job {train} is being preempted" in text, text
    # what the stop left: a tag is completed or none is started
    assert sorted(p.name for p in ckpt.glob("step_*")) == sorted(tags), tags
    assert "every rank stopped after step" in text, text
    assert ended(int(urgent.stdout.strip()))["JobState"] == "COMPLETED"
    resumed(reference, train, ckpt, log, tags, tmp_path)
