"""``--async-save`` with real processes: the tag a background thread writes is completed at the next save (which
waits for it, and says so), at the end of the run and at a SIGTERM stop; a SIGKILL while it is written leaves it
incomplete (no ``done``, no ``ckptconv.json``), and a resume starts from the previous complete tag. Each rank's
first save is held in its background thread (NXDTRAIN_TEST_HOLD_SAVE) while its main thread trains on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nxdtrain.checkpoint.save import HOLD_ENV
from tests.conftest import wait_until
from tests.nxdtrain.parallel.test_preempt import SIGTERM_EXIT, losses, run_nproc, stop, tags
from tests.nxdtrain.parallel.test_signals import (
    TRAIN_FLAGS,
    alive,
    completed,
    descendants,
    end,
    start_launcher,
)

ASYNC = ("--async-save",)
DECAY = TRAIN_FLAGS[TRAIN_FLAGS.index("--steps") + 1]  # run_nproc's schedule: the stopped run's --steps


def held(hold: Path) -> bool:
    return {p.name for p in hold.iterdir()} == {"rank-0", "rank-1"}


def reference(src: Path, steps: int, tmp: Path, *output: str) -> dict[int, float]:
    log = tmp / f"reference-{steps}.jsonl"
    run_nproc(src, steps, log, *(output or ("--no-checkpoint",)))
    return losses(log)


def test_async_tags_complete_at_the_next_save_and_at_the_end_with_a_sync_saves_files(tmp_path, nxd_model,
                                                                                     monkeypatch):
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    root, log, hold = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv(HOLD_ENV, str(hold))
    launcher = start_launcher(src, root, log, checkpoint_freq=2, steps=4, extra=(*ASYNC, "--decay-steps", DECAY))
    try:
        _, err = launcher.communicate(timeout=300)
    finally:
        end(launcher, set())
    assert launcher.returncode == 0, err
    # the held step 2 writes were waited for (on the CPU by step 3's optimizer, which changes what they write)
    assert "saved " in err and "waited" in err, err
    assert tags(root) == completed(root) == {"step_2", "step_4"}
    monkeypatch.delenv(HOLD_ENV)
    sync_root = tmp_path / "sync"
    expected = reference(src, 4, tmp_path, "--checkpoint-dir", str(sync_root), "--checkpoint-freq", "2")
    assert losses(log) == expected
    for step in ("step_2", "step_4"):  # the state files (user_content.pt records the options, which differ)
        files = sorted(p.relative_to(sync_root / step) for d in ("model", "optim") for p in (sync_root / step / d).iterdir())
        assert files == sorted(p.relative_to(root / step) for d in ("model", "optim") for p in (root / step / d).iterdir())
        for rel in files:
            assert (root / step / rel).read_bytes() == (sync_root / step / rel).read_bytes(), (step, rel)


def test_sigterm_while_an_async_save_writes_completes_it_and_its_resume_matches(tmp_path, nxd_model, monkeypatch):
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    root, log, hold = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv(HOLD_ENV, str(hold))
    launcher = start_launcher(src, root, log, checkpoint_freq=2, extra=ASYNC)
    workers: set[int] = set()
    try:
        wait_until(lambda: held(hold), "both ranks writing in the background", 180)
        workers = descendants(launcher.pid)
        assert not completed(root)  # the save is in flight
        launcher.send_signal(signal.SIGTERM)
        err = stop(launcher, workers)
        assert launcher.returncode == SIGTERM_EXIT, err
        assert "every rank stopped after step" in err and "Traceback" not in err, err
    finally:
        end(launcher, workers)
    assert "step_2" in completed(root) and tags(root) == completed(root)  # nothing left incomplete
    newest = max(int(t.removeprefix("step_")) for t in completed(root))
    monkeypatch.delenv(HOLD_ENV)
    steps = newest + 2
    resumed = tmp_path / "resumed.jsonl"
    run_nproc(root, steps, resumed, "--checkpoint-dir", str(root))
    expected = reference(src, steps, tmp_path)
    assert losses(resumed) == {k: expected[k] for k in range(newest + 1, steps + 1)}


@pytest.mark.parametrize("sharding", [(), ("--shard-params",)], ids=["replicated", "fsdp"])
def test_sigkill_while_an_async_save_writes_leaves_it_incomplete_and_a_resume_takes_the_previous(
        tmp_path, nxd_model, monkeypatch, sharding):
    """FSDP: every rank has written its rows into the files rank 0 created, which no rank has finished."""
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    root, log, hold = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "hold"
    run_nproc(src, 2, log, "--checkpoint-dir", str(root), *ASYNC, *sharding)  # step_2, completed at the end
    assert completed(root) == {"step_2"}
    hold.mkdir()
    monkeypatch.setenv(HOLD_ENV, str(hold))
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--resume", str(root), "--nproc", "2", *TRAIN_FLAGS,
            "--decay-steps", DECAY, "--checkpoint-dir", str(root), "--checkpoint-freq", "2", *ASYNC, *sharding]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    workers: set[int] = set()
    try:
        wait_until(lambda: held(hold), "both ranks writing step_4 in the background", 180)
        workers = descendants(launcher.pid)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=60)
        wait_until(lambda: not alive(workers), "the workers to die", 60)
    finally:
        end(launcher, workers)
    step4 = root / "step_4"
    assert step4.is_dir() and not (step4 / "done").exists() and not (step4 / "ckptconv.json").exists()
    if sharding:  # killed between the rows' writes and the owner's finish: its files still under temporary names
        assert {p.name for p in (step4 / "optim").iterdir()} == {".dp_rank_00_tp_rank_00_pp_rank_00.pt.partial"}
    assert completed(root) == {"step_2"}
    monkeypatch.delenv(HOLD_ENV)
    resumed = tmp_path / "resumed.jsonl"
    run_nproc(root, 8, resumed, "--checkpoint-dir", str(root), "--checkpoint-freq", "2", *ASYNC, *sharding)
    expected = reference(src, 8, tmp_path, "--no-checkpoint", *sharding)
    assert losses(resumed) == {k: expected[k] for k in range(3, 9)}
    # step_4 saved again over what the kill left (then pruned with step_2: --keep 2)
    assert tags(root) == completed(root) == {"step_6", "step_8"}
