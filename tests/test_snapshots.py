"""``from-dcp ROOT OUT --every`` (and ``--watch``): each completed step-N of a TorchTitan-style checkpoint folder
exported once into OUT/step-N, a step still being written left alone, a kill half-way redone, a step the run
deletes skipped.

References: the HF model each step was made from (safetensors' own loader on the export), and a plain one-shot
``from-dcp`` of the same step, byte for byte.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ckptconv
from ckptconv.cli.main import main
from ckptconv.commands.api import RunOptions
from ckptconv.commands.dcp import from_dcp, from_dcp_every
from ckptconv.engine.snapshots import export_every
from ckptconv.io.dcp import step_dirs
from tests.conftest import hf_state, wait_until

QUIET = RunOptions(quiet=True)
SHARD = "20KB"  # several safetensors files per step, so a kill can fall between two of them
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def root(tiny_models, tmp_path_factory) -> tuple[Path, dict[int, Path]]:
    """step-1..3 complete (each from its own HF model), step-4 still being written (no .metadata yet)."""
    base = tmp_path_factory.mktemp("titan-run") / "checkpoint"
    models = {n: tiny_models(f"snap-{n}", layers=2, seed=40 + n) for n in (1, 2, 3)}
    for n, model in models.items():
        ckptconv.to_dcp(model, base / f"step-{n}", options=QUIET)
    shutil.copytree(base / "step-3", base / "step-4")
    (base / "step-4" / ".metadata").unlink()  # DCP renames .metadata into place last
    return base, models


def files_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def one_shot(src: Path, out: Path) -> dict[str, bytes]:
    assert main(["from-dcp", str(src), str(out), "--quiet", "--max-shard-size", SHARD]) == 0
    return files_of(out)


def check_steps(out: Path, root: Path, models: dict[int, Path], steps: list[int], tmp_path: Path) -> None:
    """OUT holds exactly ``steps``, each byte-equal to a one-shot export and equal to its own HF model."""
    assert sorted(p.name for p in out.iterdir()) == [f"step-{n}" for n in steps]
    for n in steps:
        assert files_of(out / f"step-{n}") == one_shot(root / f"step-{n}", tmp_path / f"plain-{n}")
        got, want = hf_state(out / f"step-{n}"), hf_state(models[n])
        assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)


def test_every_exports_the_completed_steps_once_and_leaves_the_unfinished_one(root, tmp_path, capsys):
    base, models = root
    out = tmp_path / "snaps"
    assert main(["from-dcp", str(base), str(out), "--every", "--max-shard-size", SHARD]) == 0
    err = capsys.readouterr().err
    for n in (1, 2, 3):  # one line per step
        assert f"ckptconv: step-{n} -> {out / f'step-{n}'} (" in err
    assert "step-4" not in err
    check_steps(out, base, models, [1, 2, 3], tmp_path)
    done = from_dcp_every(base, out, max_shard_size=20_000, options=QUIET)  # a second call: nothing to do
    assert (done.exported, done.up_to_date) == ([], [1, 2, 3])


def kill_at_step_2(argv: list[str], cli: str = "ckptconv.cli.main") -> subprocess.CompletedProcess:
    """``ckptconv ARGV`` (or the ``main`` of module ``cli``: ``nxdtrain.cli``) in a child process SIGKILLed (as the OOM
    killer would) once the first file of OUT/step-2 is in place."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        import ckptconv.engine.execute as execute
        original = execute.move_into_place
        def killing(sink, tmp, out_dir):
            moved = original(sink, tmp, out_dir)
            if out_dir.name == "step-2":
                os.kill(os.getpid(), signal.SIGKILL)
            return moved
        execute.move_into_place = killing
        from {cli} import main
        sys.exit(main({argv!r}))
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_kill_in_the_middle_of_an_export_is_redone_by_the_next_call(root, tmp_path):
    base, models = root
    out = tmp_path / "snaps"
    killed = kill_at_step_2(["from-dcp", str(base), str(out), "--every", "--quiet", "--max-shard-size", SHARD,
                             "--workers", "1"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / "step-1" / "ckptconv.json").is_file()
    half = out / "step-2"
    assert not (half / "ckptconv.json").exists() and any(half.glob("*.safetensors")), sorted(os.listdir(half))
    assert not (out / "step-3").exists()
    done = from_dcp_every(base, out, max_shard_size=20 * 10**3, options=QUIET)
    assert (done.exported, done.up_to_date, done.skipped) == ([2, 3], [1], [])
    check_steps(out, base, models, [1, 2, 3], tmp_path)


def test_a_step_the_run_deletes_is_skipped_with_a_note_and_the_others_are_exported(root, tmp_path):
    base, _ = root
    run = tmp_path / "run"
    for n in (1, 2, 3):
        shutil.copytree(base / f"step-{n}", run / f"step-{n}")
    out = tmp_path / "snaps"

    def export(step: Path, into: Path):
        if step.name == "step-1":  # keep_latest_k at work while step-1 is exported: step-2 goes
            shutil.rmtree(run / "step-2")
        return from_dcp(step, into, options=QUIET)

    lines: list[str] = []
    done = export_every(lambda: step_dirs(run, completed=True), export, out, say=lines.append)
    assert (done.exported, done.skipped) == ([1, 3], [2])
    assert done.notes == ["step-2: removed by the run while it was exported (its checkpoint retention: "
                          "TorchTitan's keep_latest_k, nxdtrain's --keep); skipped"]
    assert lines[1] == done.notes[0] and sorted(p.name for p in out.iterdir()) == ["step-1", "step-3"]


def test_watch_exports_a_step_that_completes_later_and_ctrl_c_exits_0(root, tmp_path):
    base, models = root
    run = tmp_path / "run" / "checkpoint"
    shutil.copytree(base / "step-1", run / "step-1")
    out = tmp_path / "snaps"
    argv = [sys.executable, "-m", "ckptconv.cli", "from-dcp", str(run), str(out), "--every", "--watch", "0.2",
            "--max-shard-size", SHARD]
    watcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_until(lambda: (out / "step-1" / "ckptconv.json").is_file(), "step-1's export", 120)
        shutil.copytree(base / "step-2", run / "step-2", ignore=shutil.ignore_patterns(".metadata"))  # in flight
        time.sleep(1.0)
        assert not (out / "step-2").exists()
        shutil.copy(base / "step-2" / ".metadata", run / "step-2" / ".metadata.tmp")
        os.replace(run / "step-2" / ".metadata.tmp", run / "step-2" / ".metadata")  # as DCP's writer finishes
        wait_until(lambda: (out / "step-2" / "ckptconv.json").is_file(), "step-2's export", 120)
        watcher.send_signal(signal.SIGINT)
        stdout, stderr = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 0, stderr
    assert stdout.startswith(f"out: {out}\nexported: 1\n  2\nup_to_date: -\n"), stdout
    assert stderr.count(" -> ") == 2

