"""Shared helpers of the fault suite: run the real CLI, check the one-line error shape, compare trees."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    """The test's environment for a child CLI: this checkout first, no torchrun/srun world."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "CKPTCONV_DEBUG")}
    clean["PYTHONPATH"] = os.pathsep.join([str(REPO), clean.get("PYTHONPATH", "")])
    return clean


def command(prog: str, *args: str | Path) -> list[str]:
    return [sys.executable, "-m", f"{prog}.cli", *map(str, args)]


def file_size_limit(limit: int) -> Callable[[], None]:
    """preexec_fn: a disk that is full after ``limit`` bytes of any one file (RLIMIT_FSIZE; writes
    past it fail with EFBIG instead of killing the process with SIGXFSZ)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def run(prog: str, *args: str | Path, limit: int | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(prog, *args), env=env(), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=file_size_limit(limit) if limit else None)


def one_line_error(err: str, prog: str = "ckptconv") -> str:
    """The single stderr line of a failed run, checked for the promised shape."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err and "unexpected; rerun with --debug" not in err, err
    assert "weights_only=False" not in err, err
    return lines[0]


def tree(root: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under ``root`` (symlinks not followed)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def looks_complete(out: Path) -> bool:
    """Whether OUT claims to be a finished conversion (its ckptconv.json is what says so)."""
    return (out / "ckptconv.json").exists()


def consistent(out: Path) -> bool:
    """OUT's ckptconv.json lists exactly the files present besides itself (and the temporary
    directory a run killed after writing it leaves), each of the recorded size and digest."""
    from ckptconv.io.digest import FileRecord

    listed = json.loads((out / "ckptconv.json").read_text())["files"]
    present = {rel for rel in tree(out) if rel != "ckptconv.json" and not rel.startswith(".ckptconv-tmp/")}
    return set(listed) == present and all(FileRecord.from_json(r).matches(out / rel) for rel, r in listed.items())
