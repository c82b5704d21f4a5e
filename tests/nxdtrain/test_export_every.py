"""``nxdtrain export ROOT OUT --every`` on a live run: the run (a subprocess, checkpointing every step) is held
inside its save of step 4 while the export takes steps 1-3; an export killed half-way is redone by the next call;
once the run goes on, the next call takes the rest.

Reference: a plain one-shot ``nxdtrain export`` of each tag, byte for byte."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

from nxdtrain.cli import main
from tests.conftest import wait_until
from tests.nxdtrain.parallel.test_signals import TRAIN_FLAGS
from tests.test_snapshots import kill_at_step_2

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def export(*argv: str | Path) -> int:
    """``nxdtrain export ...`` in this process (the tiny model has no tokenizer: the CLI says it as a note, not as a
    warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a raw UserWarning reaching the caller would fail here
        return main(["export", *map(str, argv)])


def files_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def held_run(src: Path, root: Path, saving: Path, release: Path) -> subprocess.Popen:
    """``nxdtrain run`` for 5 steps, a tag every step, held inside its save of step 4 until ``release`` exists."""
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        import nxdtrain.checkpoint.save as checkpoint
        original = checkpoint.save_shard
        def held(path, *args, **kwargs):
            written = original(path, *args, **kwargs)
            if "step_4" in str(path):
                pathlib.Path({str(saving)!r}).write_text("1")
                deadline = time.monotonic() + 300
                while not pathlib.Path({str(release)!r}).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            return written
        checkpoint.save_shard = held
        from nxdtrain.cli import main
        sys.exit(main({["run", "--resume", str(src), *TRAIN_FLAGS[:1], "5", *TRAIN_FLAGS[2:],
                        "--checkpoint-dir", str(root), "--checkpoint-freq", "1", "--keep", "10"]!r}))
    """)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, start_new_session=True)


def test_every_exports_a_live_run_and_redoes_a_killed_export(tmp_path, nxd_model, capsys):
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    root, out, saving, release = tmp_path / "ckpt", tmp_path / "snaps", tmp_path / "saving", tmp_path / "release"
    run = held_run(src, root, saving, release)
    try:
        wait_until(lambda: saving.is_file() or run.poll() is not None, "the run to be inside its save of step 4", 240)
        assert run.poll() is None, run.communicate()[1]
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_1", "step_2", "step_3", "step_4"]
        killed = kill_at_step_2(["export", str(root), str(out), "--every"], cli="nxdtrain.cli")
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert "nxdtrain: step_1 -> " in killed.stderr
        assert (out / "step-1" / "ckptconv.json").is_file() and not (out / "step-2" / "ckptconv.json").exists()
        capsys.readouterr()
        assert export(root, out, "--every") == 0  # step 4 is still being written
        captured = capsys.readouterr()
        assert f"step_1: already exported in {out / 'step-1'}" in captured.err
        assert "step_2 -> " in captured.err and "step_3 -> " in captured.err and "step_4" not in captured.err
        assert "exported 2 step(s)" in captured.out and "(1 exported before, 0 removed by the run)" in captured.out
        assert sorted(p.name for p in out.iterdir()) == ["step-1", "step-2", "step-3"]
        release.write_text("1")
        _, err = run.communicate(timeout=240)
        assert run.returncode == 0, err
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert export(root, out, "--every") == 0  # the run's last steps
    assert sorted(p.name for p in out.iterdir()) == [f"step-{n}" for n in range(1, 6)]
    exported = {n: files_of(out / f"step-{n}") for n in range(1, 6)}
    for n in range(1, 6):
        assert export(root / f"step_{n}", tmp_path / f"plain-{n}") == 0
        assert exported[n] == files_of(tmp_path / f"plain-{n}")
    weights = [name for name in exported[1] if name.endswith(".safetensors")]
    assert weights and all(exported[1][w] != exported[3][w] for w in weights)  # training moved every file
