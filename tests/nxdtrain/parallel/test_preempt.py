"""Preemption with real processes (nxdtrain.parallel.preempt): SIGTERM during a save lets every rank finish it and
stop; SIGTERM to one rank between saves stops both at the same step and starts no save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from nxdtrain.checkpoint.save import HOLD_ENV
from tests.conftest import wait_until
from tests.nxdtrain.parallel.test_signals import (
    STOP_BOUND_S,
    TRAIN_FLAGS,
    alive,
    completed,
    descendants,
    end,
    start_launcher,
)

SIGTERM_EXIT = 128 + signal.SIGTERM


def losses(log: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, log.read_text().splitlines())}


def tags(root: Path) -> set[str]:
    """Every tag directory in ``root``, complete or not."""
    return {p.name for p in root.iterdir() if p.name.startswith("step_")}


def run_nproc(src: Path, steps: int, log: Path, *output: str) -> None:
    """``steps`` of the stopped run's schedule (its --steps is the decay length)."""
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--resume", str(src), "--nproc", "2", *TRAIN_FLAGS,
            "--log-jsonl", str(log), "--decay-steps", TRAIN_FLAGS[TRAIN_FLAGS.index("--steps") + 1], *output]
    argv[argv.index("--steps") + 1] = str(steps)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def stop(launcher: subprocess.Popen, workers: set[int]) -> str:
    """The launcher's stderr once it ended (within the grace bound), its workers gone."""
    _, err = launcher.communicate(timeout=STOP_BOUND_S)
    wait_until(lambda: not alive(workers), f"workers {sorted(alive(workers))} to exit", STOP_BOUND_S)
    return err


def test_sigterm_during_a_save_completes_the_tag_and_its_resume_matches(tmp_path, nxd_model, monkeypatch):
    """Both ranks are held inside their first save (after writing their files, NXDTRAIN_TEST_HOLD_SAVE) when the
    launcher gets SIGTERM and forwards it: the tag gets its markers, no step or save follows, the launcher exits
    143; resuming from the tag gives the uninterrupted run's losses."""
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    root, log, hold = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv(HOLD_ENV, str(hold))
    launcher = start_launcher(src, root, log, checkpoint_freq=2)
    workers: set[int] = set()
    try:
        wait_until(lambda: {p.name for p in hold.iterdir()} == {"rank-0", "rank-1"}, "both ranks inside the save",
                   180)
        workers = descendants(launcher.pid)
        assert not completed(root)  # the save is in progress
        launcher.send_signal(signal.SIGTERM)
        err = stop(launcher, workers)
        assert launcher.returncode == SIGTERM_EXIT, err
        assert "nxdtrain: SIGTERM: every rank stopped after step 2;" in err, err
        assert "saved " in err and "Traceback" not in err
    finally:
        end(launcher, workers)
    assert tags(root) == completed(root) == {"step_2"}  # completed, and nothing started after it
    assert (root / "step_2" / "checkpoint").is_file()
    assert sorted(losses(log)) == [1, 2]
    monkeypatch.delenv(HOLD_ENV)
    resumed, reference = tmp_path / "resumed.jsonl", tmp_path / "reference.jsonl"
    run_nproc(root, 4, resumed, "--checkpoint-dir", str(root))  # as a requeued job: the same directory
    run_nproc(src, 4, reference, "--no-checkpoint")
    expected = losses(reference)
    assert losses(resumed) == {3: expected[3], 4: expected[4]}
    assert {1: expected[1], 2: expected[2]} == losses(log)
    assert completed(root) == {"step_2", "step_4"}


def rank1_of(root: Path) -> int:
    """The pid of rank 1: the sibling of rank 0, which holds --checkpoint-dir's lock (both are forked from the
    launcher's forkserver)."""
    rank0 = json.loads((root / ".ckptconv-tmp/lock").read_text())["pid"]
    parent = ppid(rank0)
    siblings = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and int(p.name) != rank0
                and ppid(int(p.name)) == parent]
    assert len(siblings) == 1, siblings
    return siblings[0]


def ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def test_sigterm_to_one_rank_between_saves_stops_both_at_the_same_step(tmp_path, nxd_model):
    """Rank 1 alone gets SIGTERM (a user's kill, a late forward): rank 0 learns it at the next step boundary, both
    stop after the same step (rank 0 says which, and exits 143 itself: no lost peer, no timeout), no tag is
    started and every tag there is complete."""
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    root, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    launcher = start_launcher(src, root, log, checkpoint_freq=3)
    workers: set[int] = set()
    try:
        wait_until(lambda: log.is_file() and len(log.read_text().splitlines()) >= 4 and completed(root),
                   "four steps and a tag", 180)
        workers = descendants(launcher.pid)
        os.kill(rank1_of(root), signal.SIGTERM)
        err = stop(launcher, workers)
        assert launcher.returncode == SIGTERM_EXIT, err
        stopped = [line for line in err.splitlines() if "every rank stopped after step" in line]
        assert len(stopped) == 1, err
        last = max(losses(log))
        assert stopped[0].startswith(f"nxdtrain: SIGTERM: every rank stopped after step {last};"), err
        assert "Traceback" not in err and "timed out" not in err.lower()
    finally:
        end(launcher, workers)
    assert tags(root) == completed(root)  # no tag started and left without 'done'
