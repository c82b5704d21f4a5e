"""``from-dcp --every``: a half-export left by a killed call, whose step the run then deleted (TorchTitan's
``keep_latest_k``), is removed by the next call (what ckptconv wrote of it only, never while another call holds it);
a folder of OUT that ckptconv did not claim is left alone."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

import ckptconv
from ckptconv.commands.api import RunOptions
from ckptconv.commands.dcp import from_dcp_every
from ckptconv.engine import outdir
from tests.test_snapshots import SHARD, kill_at_step_2

QUIET = RunOptions(quiet=True)


@pytest.fixture
def killed(tiny_models, tmp_path) -> tuple[Path, Path]:
    """A run's step-1..3 (DCP) and OUT after an ``--every`` call SIGKILLed once step-2's first file was in place."""
    run, out = tmp_path / "run" / "checkpoint", tmp_path / "snaps"
    for n in (1, 2, 3):
        ckptconv.to_dcp(tiny_models(f"orphan-{n}", layers=2, seed=60 + n), run / f"step-{n}", options=QUIET)
    done = kill_at_step_2(["from-dcp", str(run), str(out), "--every", "--quiet", "--max-shard-size", SHARD,
                           "--workers", "1"])
    assert done.returncode == -signal.SIGKILL, done.stderr
    half = out / "step-2"
    assert not (half / "ckptconv.json").exists() and any(half.glob("*.safetensors"))
    assert (half / outdir.TMP_DIR).is_dir()
    return run, out


def test_a_half_export_of_a_step_the_run_deleted_is_removed_ours_only(killed):
    run, out = killed
    shutil.rmtree(run / "step-2")  # keep_latest_k deletes step-2 before the next call
    (out / "step-2" / "notes.txt").write_text("the user's")  # not ckptconv's: stays
    (out / "step-0").mkdir()  # a folder ckptconv never claimed (no .ckptconv-tmp): stays, though no step-0 is listed
    (out / "step-0" / "x.safetensors").write_bytes(b"user")
    lines: list[str] = []
    done = from_dcp_every(run, out, max_shard_size=20_000, options=QUIET, say=lines.append)
    assert (done.exported, done.up_to_date, done.skipped) == ([3], [1], [2])
    note = ("step-2: half-exported by an earlier call that was stopped, and removed by the run since (its checkpoint "
            "retention: TorchTitan's keep_latest_k, nxdtrain's --keep); what ckptconv wrote of it is removed")
    assert done.notes == [note] and lines[0] == note
    assert sorted(p.name for p in (out / "step-2").iterdir()) == ["notes.txt"]
    assert (out / "step-0" / "x.safetensors").read_bytes() == b"user"
    # with nothing of the user's in it, the folder goes too
    (out / "step-2" / "notes.txt").unlink()
    assert sorted(p.name for p in out.iterdir()) == ["step-0", "step-1", "step-2", "step-3"]  # an empty folder:
    # not ours to remove any more (its claim is gone), so the next call leaves it
    again = from_dcp_every(run, out, max_shard_size=20_000, options=QUIET)
    assert (again.exported, again.skipped, again.notes) == ([], [], [])


def test_the_folder_goes_when_only_ckptconvs_files_were_in_it(killed):
    run, out = killed
    shutil.rmtree(run / "step-2")
    done = from_dcp_every(run, out, max_shard_size=20_000, options=QUIET)
    assert done.skipped == [2]
    assert sorted(p.name for p in out.iterdir()) == ["step-1", "step-3"]


def test_a_half_export_another_call_holds_is_left_and_one_still_listed_is_resumed(killed):
    run, out = killed
    shutil.rmtree(run / "step-2")
    with outdir.acquire(out / "step-2", fingerprint="another call"):
        done = from_dcp_every(run, out, max_shard_size=20_000, options=QUIET)
    assert (done.exported, done.skipped, done.notes) == ([3], [], [])
    assert any((out / "step-2").glob("*.safetensors"))


def test_a_half_export_whose_step_is_still_there_is_resumed_not_removed(killed):
    run, out = killed
    done = from_dcp_every(run, out, max_shard_size=20_000, options=QUIET)
    assert (done.exported, done.up_to_date, done.skipped) == ([2, 3], [1], [])
    assert (out / "step-2" / "ckptconv.json").is_file()
