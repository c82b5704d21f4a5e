"""``make bench``'s training-state rows: the commands that move a training run, against ``cp -r`` of the same tag.

A training tag of Llama-3-8B layer shapes (2 layers, vocab 16384, tp 2, fp32 weights with AdamW's ``exp_avg`` and
``exp_avg_sq``: 6.85 GB) is built once, in nxdtrain's format 2 (``benchmarks.reshard_optim.build_tag``), with a
tiny tag of the same kind beside it (the 70B heads with tiny tensors) and a TorchTitan DCP of each (from-dcp's
source, not timed). Each command then runs on both: the tiny run is its start-up, the figures that scale are the
marginal ones (command minus start-up): marginal wall against ``cp -r`` of the same source right before the pair of
runs (before and after trees), and marginal CPU seconds (user + system, the child's own ``rusage``) per GB of the
source against cp's.

The page cache stays warm on both sides (a 2-core machine shared with other jobs: the disk would decide
everything); ``sync`` runs before each command and after it, inside its wall time. With ``--before DIR`` every
command runs from that source tree too (``PYTHONPATH=DIR``), in the same repetition, alternating which tree goes
first, so both see the same load. Medians over ``--repeat`` runs, with the range of the per-run ratios.

    python benchmarks/run.py --training [--repeat 3] [--before /path/to/older/tree]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from measure import Run, du, measure

REPO = Path(__file__).resolve().parent.parent

# (row label, argv after "ckptconv" with SRC and OUT placeholders, source kind: the tag or its DCP)
COMMANDS = [
    ("reshard --tp 4 (nxdtrain's format)", ["reshard", "SRC", "OUT", "--tp", "4", "--pp", "1"], "tag"),
    ("reshard --tp 4 --optimizer-format nxd", ["reshard", "SRC", "OUT", "--tp", "4", "--pp", "1",
                                               "--optimizer-format", "nxd"], "tag"),
    ("to-dcp (weights + AdamW state)", ["to-dcp", "SRC", "OUT"], "tag"),
    ("from-dcp --to nxd --tp 2", ["from-dcp", "SRC", "OUT", "--to", "nxd", "--tp", "2"], "dcp"),
]


@dataclass
class Row:
    command: str
    tree: str
    gb: float  # source bytes / 1e9
    runs: list[Run] = field(default_factory=list)
    startup: list[Run] = field(default_factory=list)
    cp: list[Run] = field(default_factory=list)

    def marginal_ratios(self) -> list[float]:
        start = statistics.median(r.wall for r in self.startup)
        return sorted((r.wall - start) / c.wall for r, c in zip(self.runs, self.cp, strict=True))

    def line(self) -> str:
        med = statistics.median
        start, start_cpu = med(r.wall for r in self.startup), med(r.cpu for r in self.startup)
        ratios = self.marginal_ratios()
        cpu = (med(r.cpu for r in self.runs) - start_cpu) / self.gb
        cp_cpu = med(c.cpu for c in self.cp) / self.gb
        return (f"| {self.command} | {self.tree} | {len(self.runs)} | {med(r.wall for r in self.runs):.1f} ({start:.1f}) | "
                f"{med(c.wall for c in self.cp):.1f} | {med(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | "
                f"{cpu:.2f} ({cp_cpu:.2f}) | {max(r.rss for r in self.runs) / 2**20:.0f} MiB |")


def tree_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def build(out: Path, names: tuple[str, ...] = ("big", "tiny")) -> dict[str, Path]:
    """The tags and their DCPs (kept between runs: rebuilt only when missing). Built in child processes: a child
    forked from a process that held GBs of shards would report that process's RSS as its own peak."""
    paths = {}
    for name, shape, vocab in (("big", "8b", 16384), ("tiny", "70b-tiny", 1024)):
        if name not in names:
            continue
        work = out / f"train-{name}"
        tag, dcp = work / "tag", work / "dcp"
        if not (tag / "done").is_file():
            shutil.rmtree(work, ignore_errors=True)
            print(f"building the {name} training tag ...", flush=True)
            code = (f"from benchmarks.reshard_optim import build_tag; from pathlib import Path; "
                    f"build_tag(Path({str(work)!r}), {shape!r}, 2, {vocab}, tp=2, dtype='fp32', schedule='CosineAnnealing')")
            subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=tree_env(REPO))
        if not (dcp / "ckptconv.json").is_file():
            shutil.rmtree(dcp, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "ckptconv.cli", "to-dcp", str(tag), str(dcp), "--quiet"], check=True,
                           stdout=subprocess.DEVNULL, env=tree_env(REPO))
        paths[f"{name}-tag"], paths[f"{name}-dcp"] = tag, dcp
    return paths


def training_rows(out: Path, repeat: int, before: Path | None) -> str:
    out = out.resolve()  # the commands run in it (cwd), so their paths must not be relative to the checkout
    paths = build(out)
    trees = [("after", REPO)] + ([("before", before)] if before else [])
    rows = {(c, t): Row(c, t, du(paths[f"big-{kind}"]) / 1e9) for c, _, kind in COMMANDS for t, _ in trees}
    target, copy = out / "train-out", out / "train-cp"
    for i in range(repeat):
        for command, argv, kind in COMMANDS:
            shutil.rmtree(copy, ignore_errors=True)
            baseline = measure(["cp", "-r", str(paths[f"big-{kind}"]), str(copy)])  # one cp for both trees' runs
            shutil.rmtree(copy)
            for tree, root in trees if i % 2 == 0 else trees[::-1]:
                row = rows[(command, tree)]
                row.cp.append(baseline)
                for size, runs in (("tiny", row.startup), ("big", row.runs)):
                    src = paths[f"{size}-{kind}"]
                    shutil.rmtree(target, ignore_errors=True)
                    args = [str(src) if a == "SRC" else str(target) if a == "OUT" else a for a in argv]
                    runs.append(measure([sys.executable, "-m", "ckptconv.cli", *args, "--quiet"], tree_env(root),
                                        cwd=out))  # not the checkout: `-m` puts the cwd before PYTHONPATH
                    shutil.rmtree(target)
                r, c = row.runs[-1], row.cp[-1]
                print(f"{command} [{tree}]: {r.wall:.1f} s (start-up {row.startup[-1].wall:.1f}), cp -r {c.wall:.1f} s; "
                      f"CPU {r.cpu:.1f} s (cp {c.cpu:.1f}), peak RSS {r.rss / 2**20:.0f} MiB", flush=True)
    lines = ["| command | tree | runs | wall s (start-up) | cp -r s | marginal ratio to cp (range) | "
             "marginal CPU s/GB (cp's) | peak RSS |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [row.line() for row in rows.values()]
    gb = rows[(COMMANDS[0][0], "after")].gb
    return "\n".join(lines) + f"\n\ntraining tag: {gb:.2f} GB ({paths['big-tag']}); warm page cache, sync after each\n"
