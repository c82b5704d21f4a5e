"""``make bench-startup``: how long the CLIs take to answer what needs no computation.

Each command runs in a fresh process ``--repeat`` times (default 5) and the median wall time is
reported, with the floor (``python -c pass``) and the cost of ``import torch`` for comparison. With
``--before DIR`` (a source tree of an earlier commit, e.g. ``git archive <rev> | tar -x -C DIR``)
the same commands also run from that tree (``PYTHONPATH=DIR``, same interpreter and packages),
alternating with this checkout's in every repetition, so both see the same machine load.

    python benchmarks/startup.py [--repeat N] [--before DIR]

The last rows are conversions' start-up (issue #33): the four training-state commands of
``benchmarks/training_rows.py`` on its tiny tag (the 70B heads with tiny tensors, nxdtrain's format 2
with AdamW state, and its TorchTitan DCP; built once under ``bench-out/train-tiny``), each the whole
command in a fresh process with ``sync`` before it and inside its time, OUT removed between runs.
``--only conversions`` (or ``answers``) runs one group (and the floor rows). The load average is sampled before each
repetition and reported with the table, and each conversion's median above torch's import (imported as the CLI
imports it, in the same runs) below it. ``--bytecode compiled`` (the default) writes each tree's bytecode first, as
``pip install`` does; ``--bytecode source`` runs copies of the trees without it, under PYTHONDONTWRITEBYTECODE, so
every start compiles ckptconv's modules (~0.1 s on this machine).

The table goes to stdout and ``bench-out/startup.md``. Every command's exit status is checked
(0 for answers and conversions, 2 for usage errors, 1 for config errors): a command that fails
differently is a broken benchmark, not a fast one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_rows import COMMANDS as TRAINING  # noqa: E402
from training_rows import build, measure  # noqa: E402

OUT = Path("bench-out")
CKPTCONV = "import sys; from ckptconv.cli.main import main; sys.exit(main())"  # what the console script runs
NXDTRAIN = "import sys; from nxdtrain.cli import main; sys.exit(main())"
# torch imported as a conversion imports it: collector paused, then frozen; ended without the interpreter's teardown
TORCH_AS_THE_CLI = "import torch as the CLI does (collector paused, no teardown)"
PACKAGES = ("ckptconv", "nxdtrain")


def commands(tmp: Path) -> list[tuple[str, list[str], int]]:
    """(label, argv after the interpreter, expected exit status)."""
    bad_yaml = tmp / "bad.yaml"
    bad_yaml.write_text("resume: /fsx/llama-nxd\nsteps: 10\nlearning_rate: 3.0e-4\nglobal_batch: 8\n")
    ck, nt = ["-c", CKPTCONV], ["-c", NXDTRAIN]
    return [
        ("python -c pass (floor)", ["-c", "pass"], 0),
        ("python -c 'import torch'", ["-c", "import torch"], 0),
        (TORCH_AS_THE_CLI, ["-c", "import atexit, gc, os; atexit.register(os._exit, 0); gc.disable(); import torch; "
                                  "gc.freeze(); gc.enable()"], 0),
        ("ckptconv --version", [*ck, "--version"], 0),
        ("ckptconv --help", [*ck, "--help"], 0),
        ("ckptconv to-nxd --help", [*ck, "to-nxd", "--help"], 0),
        ("ckptconv to-nxd (missing SRC OUT: usage error)", [*ck, "to-nxd"], 2),
        ("ckptconv to-nxd SRC OUT --workers 0 (config error)", [*ck, "to-nxd", str(tmp / "src"), str(tmp / "out"),
                                                                 "--tp", "1", "--workers", "0"], 1),
        ("nxdtrain --version", [*nt, "--version"], 0),
        ("nxdtrain --help", [*nt, "--help"], 0),
        ("nxdtrain run --help", [*nt, "run", "--help"], 0),
        ("nxdtrain run --tp (usage error)", [*nt, "run", "--tp"], 2),
        ("nxdtrain run --resume X --lr -1 (config error)", [*nt, "run", "--resume", str(tmp / "x"), "--lr", "-1"], 1),
        ("nxdtrain run --config bad.yaml (unknown keys)", [*nt, "run", "--config", str(bad_yaml)], 1),
    ]


def conversions(paths: dict[str, Path], tmp: Path) -> list[tuple[str, list[str], int]]:
    """training_rows' four commands on its tiny tag (start-up: everything but the bytes), OUT under ``tmp``."""
    out = str(tmp / "conv-out")
    cases = []
    for label, argv, kind in TRAINING:
        args = [str(paths[f"tiny-{kind}"]) if a == "SRC" else out if a == "OUT" else a for a in argv]
        cases.append((f"ckptconv {label.split(' (')[0]} (tiny tag, sync)", ["-m", "ckptconv.cli", *args, "--quiet"], 0))
    return cases


def prepare_trees(trees: dict[str, str], bytecode: str, tmp: Path) -> dict[str, str]:
    """The trees to run, by variant. ``compiled``: each tree's bytecode written first, as ``pip install`` writes it
    (an editable install caches it on first use unless PYTHONDONTWRITEBYTECODE is set). ``source``: the packages
    copied without their ``__pycache__``, so that every start compiles them (run with PYTHONDONTWRITEBYTECODE)."""
    if os.environ.get("PYTHONPYCACHEPREFIX"):
        raise SystemExit("PYTHONPYCACHEPREFIX is set: torch's installed bytecode is not read under it (compiled "
                         "again at every start with PYTHONDONTWRITEBYTECODE, or cached on the first); unset it")
    prepared = {}
    for variant, tree in trees.items():
        if bytecode == "compiled":
            subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(Path(tree) / p) for p in PACKAGES)],
                           check=True, stdout=subprocess.DEVNULL)
            prepared[variant] = tree
        else:
            copy = tmp / f"tree-{variant}"
            for package in PACKAGES:
                shutil.copytree(Path(tree) / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
            prepared[variant] = str(copy)
    return prepared


def run_once(argv: list[str], expected: int, pythonpath: str | None, cwd: Path) -> tuple[float, float]:
    """(wall s, the child's user + system CPU s); the CPU figure moves less with the machine's load."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    if argv[:2] == ["-m", "ckptconv.cli"]:  # a conversion: OUT fresh, sync before and inside the time
        shutil.rmtree(cwd / "conv-out", ignore_errors=True)
        run = measure([sys.executable, *argv], env, cwd)
        return run.wall, run.cpu
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=cwd)  # not this checkout: `-c` puts the cwd first on sys.path
    stderr = proc.stderr.read() if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != expected:
        raise SystemExit(f"{argv}: exit {code}, expected {expected}\n{stderr[-2000:]}")
    return seconds, usage.ru_utime + usage.ru_stime


def table(cases: list[tuple[str, list[str], int]], variants: list[str],
          times: dict[tuple[str, str], list[tuple[float, float]]]) -> list[str]:
    """Median wall (range) and median CPU per tree; with a before tree, before / now of both medians."""
    before = "before" in variants
    header = "| command | " + " | ".join(f"{v} wall s (range) | {v} CPU s" for v in variants)
    lines = [header + (" | before / now (wall, CPU) |" if before else " |"),
             "|" + " --- |" * (1 + 2 * len(variants) + before)]
    for label, _, _ in cases:
        cells, med = [], {}
        for v in variants:
            wall, cpu = [t[0] for t in times[label, v]], [t[1] for t in times[label, v]]
            med[v] = statistics.median(wall), statistics.median(cpu)
            cells += [f"{med[v][0]:.2f} ({min(wall):.2f}-{max(wall):.2f})", f"{med[v][1]:.2f}"]
        if before:
            cells.append(f"{med['before'][0] / med['now'][0]:.2f}x, {med['before'][1] / med['now'][1]:.2f}x")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def above_torch(cases: list[tuple[str, list[str], int]], variants: list[str],
                times: dict[tuple[str, str], list[tuple[float, float]]]) -> str:
    """Each conversion's median wall above torch's import as the CLI imports it, in the same runs: the share of
    start-up that is not torch's (which moves with the machine's load far more than ckptconv's own part). It
    includes the conversion's ``sync`` (inside its time; the floor row has none) and the tiny tag's conversion."""
    labels = [label for label, _, _ in cases if "tiny tag" in label]
    if not labels:
        return ""
    lines = []
    for v in variants:
        floor = statistics.median(t[0] for t in times[TORCH_AS_THE_CLI, v])
        above = [f"{label.split(' (')[0].removeprefix('ckptconv ')} {statistics.median(t[0] for t in times[label, v]) - floor:+.2f}"
                 for label in labels]
        lines.append(f"{v}: above torch's import (the CLI's way), median s: " + ", ".join(above))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each command (median reported; default 5)")
    parser.add_argument("--before", metavar="DIR", help="source tree of an earlier commit to compare against")
    parser.add_argument("--only", choices=("answers", "conversions"), default=None, help="run one group of rows")
    parser.add_argument("--bytecode", choices=("compiled", "source"), default="compiled",
                        help="compiled: the trees' bytecode written first, as pip install writes it (default); "
                             "source: compiled at every start (PYTHONDONTWRITEBYTECODE, no __pycache__)")
    args = parser.parse_args()
    if args.bytecode == "source":
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # the children inherit it
    OUT.mkdir(exist_ok=True)
    # this checkout by path, not the installed package (an editable install may point at another worktree)
    variants = {"now": str(Path(__file__).resolve().parent.parent)}
    if args.before:
        variants = {"before": str(Path(args.before).resolve()), **variants}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = prepare_trees(variants, args.bytecode, Path(tmp))
        cases = commands(Path(tmp))[:3 if args.only == "conversions" else None]  # the floor rows always
        if args.only != "answers":
            cases += conversions(build(OUT.resolve(), names=("tiny",)), Path(tmp))
        times: dict[tuple[str, str], list[tuple[float, float]]] = {(c[0], v): [] for c in cases for v in variants}
        for i in range(args.repeat):
            loads.append(os.getloadavg()[0])
            for label, argv, expected in cases:
                for v in list(variants) if i % 2 == 0 else list(reversed(variants)):
                    times[label, v].append(run_once(argv, expected, variants[v], Path(tmp)))
    loads.append(os.getloadavg()[0])
    bytecode = {"compiled": "compiled before the runs (as pip install writes it)",
                "source": "compiled at every start (PYTHONDONTWRITEBYTECODE, no __pycache__)"}[args.bytecode]
    text = "\n".join(table(cases, list(variants), times)) + (
        f"\n\n{args.repeat} runs each; 1-minute load average {min(loads):.1f}-{max(loads):.1f} (median "
        f"{statistics.median(loads):.1f}) over the runs; {os.cpu_count()} cores; ckptconv's bytecode {bytecode}\n"
        + above_torch(cases, list(variants), times))
    print(text)
    (OUT / "startup.md").write_text(text)


if __name__ == "__main__":
    main()
