"""Signals with real processes: SIGTERM to the --nproc launcher stops every worker; a worker killed (SIGKILL: what
ends a save the grace time did not cover) during a save leaves a tag that nothing reads as complete. SIGTERM during a
save: tests/nxdtrain/parallel/test_preempt.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckptconv.cli.main import main as ckptconv_main
from nxdtrain.checkpoint.resume import resolve_resume
from nxdtrain.errors import TrainError
from tests.conftest import wait_until

TRAIN_FLAGS = ["--steps", "100000", "--data", "synthetic", "--seq-len", "16", "--gbs", "4", "--mbs", "1",
               "--optimizer", "sgd", "--precision", "fp32"]
STOP_BOUND_S = 45.0  # the launcher's grace (30 s) plus slack on a busy machine


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc; zombies count as gone)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if state[state.rindex(")") + 2] != "Z":
            out.add(pid)
    return out


def completed(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if (p / "done").is_file()} if root.is_dir() else set()


def kill_leftovers(pids: set[int]) -> None:
    for pid in alive(pids):  # only processes this test started; on failure they must not outlive it
        os.kill(pid, signal.SIGKILL)


def end(launcher: subprocess.Popen, workers: set[int]) -> None:
    """However the test went: the launcher ended, its pipes closed (never read when the test passes), nothing it
    started left alive."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()
    launcher.stdout.close()
    launcher.stderr.close()
    kill_leftovers(workers | descendants(launcher.pid))


def start_launcher(src: Path, root: Path, log: Path, *, checkpoint_freq: int, steps: int = 100000,
                   extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """`nxdtrain run --nproc 2` training (for ever, or ``steps``) from ``src`` into ``root``, in a session of its
    own."""
    flags = [*TRAIN_FLAGS]
    flags[flags.index("--steps") + 1] = str(steps)
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--resume", str(src), "--nproc", "2", *flags, *extra,
            "--checkpoint-dir", str(root), "--checkpoint-freq", str(checkpoint_freq), "--log-jsonl", str(log)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path, nxd_model):
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    root, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    launcher = start_launcher(src, root, log, checkpoint_freq=2)
    workers: set[int] = set()
    try:
        wait_until(lambda: log.is_file() and len(log.read_text().splitlines()) >= 3 and completed(root),
                   "three training steps and a tag", 180)
        workers = descendants(launcher.pid)
        assert len(workers) >= 2  # the two workers (and the forkserver they were forked from)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=STOP_BOUND_S)
        wait_until(lambda: not alive(workers), f"workers {sorted(alive(workers))} to exit", STOP_BOUND_S)
        assert launcher.returncode == 128 + signal.SIGTERM, err
        assert "nxdtrain: SIGTERM: stopped all 2 processes" in err
        tags, entries = completed(root), sorted(p.name for p in root.iterdir())
        steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
        time.sleep(2)  # nobody is left to write: no tag appears or completes later, no step is logged
        assert completed(root) == tags and sorted(p.name for p in root.iterdir()) == entries
        assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == steps
        for name in tags:  # what is complete is intact (checked reads of every file)
            assert ckptconv_main(["inspect", str(root / name), "--json"]) == 0
    finally:
        end(launcher, workers)


def test_sigkill_during_a_save_leaves_no_complete_tag(tmp_path, nxd_model, hf_model, capsys):
    """The worker is held inside its save (after its shard is written) and then sent SIGKILL (SIGTERM would wait
    for the save to end: test_preempt.py)."""
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    root, flag = tmp_path / "ckpt", tmp_path / "saving"
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        import nxdtrain.checkpoint.save as checkpoint
        original = checkpoint.save_shard
        def held(*args, **kwargs):
            written = original(*args, **kwargs)
            pathlib.Path({str(flag)!r}).write_text("1")
            time.sleep(300)
            return written
        checkpoint.save_shard = held
        from nxdtrain.cli import main
        sys.exit(main({["run", "--resume", str(src), *TRAIN_FLAGS[:1], "1", *TRAIN_FLAGS[2:],
                        "--checkpoint-dir", str(root)]!r}))
    """)
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        wait_until(flag.is_file, "the save to start", 180)
        worker.send_signal(signal.SIGKILL)
        worker.communicate(timeout=STOP_BOUND_S)
        assert worker.returncode == -signal.SIGKILL
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    tag = root / "step_1"
    assert (tag / "model/dp_rank_00_tp_rank_00_pp_rank_00.pt").is_file() and not (tag / "done").exists()
    with pytest.raises(TrainError, match=r"no NxD shards found"):
        resolve_resume(str(root), weights_only=False)  # the root has no completed tag
    with pytest.raises(TrainError, match=r"tag has no 'done' marker \(an interrupted save\)"):
        resolve_resume(str(tag), weights_only=False)
    config = str(hf_model("mha") / "config.json")
    capsys.readouterr()
    assert ckptconv_main(["inspect", str(tag), "--config", config]) == 1
    assert "tag has no 'done' marker" in capsys.readouterr().err
    assert ckptconv_main(["to-hf", str(tag), str(tmp_path / "hf"), "--config", config, "--quiet"]) == 1
    assert not (tmp_path / "hf" / "ckptconv.json").exists()


KILL_BOUND_S = 15.0  # the workers' watchdog polls every 0.5 s; slack for a busy machine


def test_kill9_of_the_launcher_leaves_no_worker_and_a_second_writer_is_refused(tmp_path, nxd_model):
    """What the OOM killer does to `nxdtrain run --nproc 2`: no worker goes on training and saving alone; while
    the run lives, a second run into its --checkpoint-dir is refused naming it; once it is gone, the dir is free."""
    from ckptconv.engine import outdir

    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    root, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    launcher = start_launcher(src, root, log, checkpoint_freq=50)
    workers: set[int] = set()
    try:
        wait_until(lambda: log.is_file() and len(log.read_text().splitlines()) >= 2 and completed(root),
                   "two training steps and a tag", 180)
        # The second writer: a resume of the same directory (a requeued job while the first still runs).
        second = subprocess.run([sys.executable, "-m", "nxdtrain.cli", "run", "--resume", str(root), *TRAIN_FLAGS,
                                 "--checkpoint-dir", str(root)], capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        holder = json.loads((root / ".ckptconv-tmp/lock").read_text())
        assert second.stderr.startswith(f"nxdtrain: error: --checkpoint-dir {root}: another training run writes "
                                        f"there (pid {holder['pid']} on "), second.stderr
        assert f"launcher pid {launcher.pid}" in second.stderr and "\n" not in second.stderr.strip()
        workers = descendants(launcher.pid)
        assert holder["pid"] in workers
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        wait_until(lambda: not alive(workers), f"workers {sorted(alive(workers))} to die with the launcher",
                   KILL_BOUND_S)
        outdir.check_free(root)  # the dead run's lock is free again
    finally:
        end(launcher, workers)
