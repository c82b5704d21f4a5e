"""The TorchTitan lane: docs/checking.md's "Checking a migration" walk is run as written, and what it shows is what
the run printed.

The walk's fenced block is parsed: each ``$ `` line is a command, the lines after it what the command printed on
stdout, an ``[exit N]`` line its exit status (0 where none is shown). A line ``...`` stands for any lines, ``...``
inside a line for any text (timestamps, timings, absolute paths). The commands run in order in a tmp dir holding
``llama-hf`` (``tests/conftest.py::make_tiny_llama``: 8 heads over 2 KV heads, hidden 64, intermediate 96):
``ckptconv`` as the console script, and ``torchrun --nproc_per_node 1 -m torchtitan.train ARGS`` as TorchTitan
0.3.0's own entry with the same ARGS under the harness shims (``tests/titan_torchrun.py``).

``WALK_TRANSCRIPT=FILE`` writes the run's own transcript there (to copy into the doc)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")

from tests.conftest import make_tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "checking.md"
SECTION = "## Checking a migration"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXIT = re.compile(r"^\[exit (\d+)\]$")
TORCHRUN = ["torchrun", "--nproc_per_node", "1", "-m", "torchtitan.train"]


def walk_steps(text: str) -> list[tuple[str, list[str], int]]:
    """(command, the output lines shown, the exit status shown) of the first ``text`` block after SECTION."""
    block = text.split(SECTION, 1)[1].split("```text\n", 1)[1].split("\n```", 1)[0]
    steps: list[tuple[str, list[str], int]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], [], 0))
        elif EXIT.match(line):
            command, shown, _ = steps[-1]
            steps[-1] = (command, shown, int(EXIT.match(line).group(1)))  # type: ignore[union-attr]
        else:
            steps[-1][1].append(line)
    return steps


def shown_pattern(shown: list[str]) -> re.Pattern[str]:
    """The lines a command's output must be: ``...`` alone any lines, ``...`` in a line any text."""
    parts = ["(?:.*\n)*?" if line == "..." else ".*".join(map(re.escape, line.split("..."))) + "\n" for line in shown]
    return re.compile("".join(parts))


def argv(command: str, cwd: Path) -> tuple[list[str], dict[str, str]]:
    """The process a command of the walk runs here, and its environment (``NAME=value`` prefixes)."""
    words = shlex.split(command)
    env = dict(os.environ)
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = str((cwd / value).resolve()) if name == "PYTHONPATH" else value
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    if words[0] == "ckptconv":
        return [str(Path(sys.executable).parent / "ckptconv"), *words[1:]], env
    assert words[:len(TORCHRUN)] == TORCHRUN, f"the walk runs ckptconv and {' '.join(TORCHRUN)} only: {command}"
    return [sys.executable, "-m", "tests.titan_torchrun", *words[len(TORCHRUN):]], env


def test_the_migration_walk_runs_as_written(tmp_path):
    steps = walk_steps(DOC.read_text())
    runs = [argv(command, tmp_path) for command, _, _ in steps]
    # the walk is the whole migration: to-dcp, TorchTitan's trainer, from-dcp, diff against the source
    verbs = ["torchrun" if "tests.titan_torchrun" in args else args[1] for args, _ in runs]
    assert verbs.index("to-dcp") < verbs.index("torchrun") < verbs.index("from-dcp") < len(verbs) - verbs[::-1].index(
        "diff") - 1, verbs
    make_tiny_llama(tmp_path / "llama-hf")
    transcript: list[str] = []
    for (command, shown, status), (args, env), verb in zip(steps, runs, verbs, strict=True):
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        out = ANSI.sub("", done.stdout)
        transcript += [f"$ {command}", *out.splitlines(), *([f"[exit {done.returncode}]"] if done.returncode else [])]
        if os.environ.get("WALK_TRANSCRIPT"):
            Path(os.environ["WALK_TRANSCRIPT"]).write_text("\n".join(transcript) + "\n")
        assert done.returncode == status, (command, done.returncode, done.stderr[-3000:])
        assert shown_pattern(shown).fullmatch(out), (command, shown, out)
        if verb == "diff":  # a diff shows its summary as printed, nothing of it elided
            assert any(line.startswith("summary: ") and "..." not in line for line in shown), command
