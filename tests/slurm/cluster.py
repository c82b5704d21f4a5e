"""The Slurm lane's view of its cluster (started by tools/slurm_lane.sh): submit the templates with sbatch as a user
does, read a job's state from scontrol and its exit from the job completion log (jobcomp/filetxt; there is no
slurmdbd, so no sacct)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "examples" / "slurm"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}
# The job names the templates set (#SBATCH --job-name): their output files are NAME-JOBID.out in the submit directory.
JOB_NAMES = {"convert.sbatch": "ckptconv-convert", "train.sbatch": "nxdtrain", "export.sbatch": "ckptconv-export"}
_FIELD = re.compile(r"(\w+)=(\S*)")
POLL = 0.2  # seconds between two looks at a job (each an scontrol or a read of the jobcomp log)


def state_dir() -> Path:
    return Path(os.environ["SLURM_LANE_STATE"])


def slurm(*argv: str) -> str:
    """A Slurm client command's stdout; its stderr in the failure."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
    return done.stdout


def sbatch(template: str, options: list[str], cwd: Path, args: tuple[str, ...] = (), **env: str) -> int:
    """``VAR=... sbatch --parsable OPTIONS examples/slurm/TEMPLATE ARGS`` run in ``cwd``: the job id."""
    done = subprocess.run(["sbatch", "--parsable", *options, str(TEMPLATES / template), *args], cwd=cwd,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().split(";")[0])


def job(job_id: int) -> dict[str, str]:
    """``scontrol show job -o``'s fields (the lane keeps ended jobs for an hour: MinJobAge)."""
    return dict(_FIELD.findall(slurm("scontrol", "show", "job", "-o", str(job_id))))


def wait_state(job_id: int, states: set[str], timeout: float = 300) -> dict[str, str]:
    """The job's fields once its state is one of ``states``."""
    seen: dict[str, str] = {}

    def reached() -> bool:
        seen.update(job(job_id))
        return seen["JobState"] in states

    wait_until(reached, f"job {job_id} to be {'/'.join(sorted(states))} (last {seen.get('JobState')})", timeout,
               poll=POLL)
    return seen


def completions(job_id: int) -> list[dict[str, str]]:
    """Every record the job completion log holds for the job: one per end of a start (a requeue's is PENDING)."""
    log = state_dir() / "jobcomp.txt"
    lines = log.read_text().splitlines() if log.exists() else []
    return [dict(_FIELD.findall(line)) for line in lines if line.startswith(f"JobId={job_id} ")]


def ended(job_id: int, timeout: float = 300) -> dict[str, str]:
    """Wait for the job to end; its last completion record (state and ``ExitCode`` as Slurm recorded them)."""
    wait_state(job_id, ENDED, timeout)
    wait_until(lambda: any(r["JobState"] in ENDED for r in completions(job_id)), f"job {job_id} in the jobcomp log", 30,
               poll=POLL)
    return completions(job_id)[-1]


def never_started(job_id: int) -> bool:
    """Slurm cancelled the job without giving it a node (what --kill-on-invalid-dep does to a pending dependent)."""
    records = completions(job_id)
    return len(records) == 1 and records[0]["JobState"] == "CANCELLED" and records[0]["NodeList"] == "(null)"


def output(template: str, job_id: int, cwd: Path) -> Path:
    """The job's output file (#SBATCH --output=%x-%j.out, in the directory it was submitted from)."""
    return cwd / f"{JOB_NAMES[template]}-{job_id}.out"


def losses(log: Path) -> dict[int, float]:
    """{step: loss} of a --log-jsonl file; a step logged twice (trained again after a resume) must agree."""
    seen: dict[int, float] = {}
    for line in log.read_text().splitlines():
        row = json.loads(line)
        assert seen.setdefault(row["step"], row["loss"]) == row["loss"], f"step {row['step']} logged twice, unequal"
    return seen


def completed_tags(ckpt: Path) -> list[str]:
    return sorted((p.name for p in ckpt.glob("step_*") if (p / "done").exists()), key=lambda n: int(n[5:]))
