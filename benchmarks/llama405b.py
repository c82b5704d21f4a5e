"""The Llama-3.1-405B-shaped rows of ``make bench`` (``make bench-405b``: 3 repeats, ``--before DIR`` for the same
commands from an older tree in the same run).

One 405B-shaped decoder layer (hidden 16384, ffn 53248, 128 query heads, 8 K/V heads, vocab 128256: 14.8 GB bf16,
single matrices of 0.54-1.74 GB, a 4.2 GB embedding and lm_head) to NxD at tp 32, kvm 4, QKV linear (o_proj
column-major), fused QKV, at ``--max-memory`` 1, 2 (the default) and 4 GiB; with ``--405b-commands`` also to-hf of
those shards and their reshard to tp 16 kvm 2 (the shards made once, by this tree). Each budget's runs (after, then
before when given) follow one ``cp -r`` of the command's input, and every ratio is to that copy; the page cache is dropped before each
command where the kernel allows (both read from disk). Reported per tree and budget: the median ratio to cp and its
range, CPU s/GB written (user + system), peak RSS, and the load average (``os.getloadavg``) at each run's start.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from measure import du, measure
from synth import write_model

REPO = Path(__file__).resolve().parent.parent
BUDGETS = ("1GiB", "2GiB", "4GiB")


@dataclass
class Cell:
    """One tree at one budget: its runs."""

    walls: list[float] = field(default_factory=list)
    cps: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    load: list[float] = field(default_factory=list)


# each command: its argv from (input, output, budget), and what it reads: the HF layer or the NxD shards of it
COMMANDS = ("to-nxd", "to-hf", "reshard")


def _argv(command: str, src: Path, dst: Path, budget: str) -> list[str]:
    head = [sys.executable, "-m", "ckptconv.cli", command, str(src), str(dst), "--max-memory", budget, "--quiet"]
    if command == "to-nxd":
        return head + ["--tp", "32", "--qkv-linear", "--fuse-qkv", "--kv-size-multiplier", "4"]
    if command == "reshard":  # tp 32 -> 16, kvm 4 -> 2: every column-major o_proj shard built from two
        return head + ["--tp", "16", "--kv-size-multiplier", "2"]
    return head


def llama405b_rows(out: Path, repeat: int, before: Path | None, commands: tuple[str, ...] = ("to-nxd",)) -> str:
    """Generate the layer under ``out`` (and, for to-hf and reshard, its NxD shards, once, by this tree's to-nxd),
    run each command at every budget ``repeat`` times (alternating the trees), delete what was written; the tables
    (markdown)."""
    out = out.resolve()
    src, shards, dst, copy = out / "hf-405b-1l", out / "nxd-405b-in", out / "nxd-405b", out / "cp-405b"
    if not (src / "config.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        print("generating hf-405b-1l (Llama-3.1-405B shapes, 1 layer, 14.8 GB) ...", flush=True)
        write_model(src, "405b", 1)
    trees = [("after", REPO)] + ([("before", before.resolve())] if before else [])
    tables = []
    for command in commands:
        source = src if command == "to-nxd" else shards
        if command != "to-nxd" and not (shards / "ckptconv.json").is_file():
            shutil.rmtree(shards, ignore_errors=True)
            measure(_argv("to-nxd", src, shards, "4GiB"), {**os.environ, "PYTHONPATH": str(REPO)}, REPO)
        if "to-nxd" not in commands[commands.index(command):]:
            shutil.rmtree(src, ignore_errors=True)  # read by to-nxd only: its 14.8 GB go before the next outputs
        cells, written = _runs(command, source, dst, copy, trees, repeat)
        tables.append(_table(command, cells, trees, du(source), written))
    for path in (src, shards):
        shutil.rmtree(path, ignore_errors=True)
    return "\n\n".join(tables)


def _runs(command: str, src: Path, dst: Path, copy: Path, trees: list[tuple[str, Path]],
          repeat: int) -> tuple[dict[tuple[str, str], Cell], int]:
    """``repeat`` rounds of: per budget, one ``cp -r`` of the command's input, then the command from each tree."""
    cells = {(name, budget): Cell() for name, _ in trees for budget in BUDGETS}
    written = 0
    for _ in range(repeat):
        for budget in BUDGETS:
            shutil.rmtree(copy, ignore_errors=True)
            cp = measure(["cp", "-r", str(src), str(copy)], cold=True).wall
            shutil.rmtree(copy)
            for name, tree in trees:
                shutil.rmtree(dst, ignore_errors=True)
                cell = cells[name, budget]
                cell.load.append(os.getloadavg()[0])
                # cwd: `-m` puts it before PYTHONPATH on sys.path, so the tree's own ckptconv runs
                run = measure(_argv(command, src, dst, budget), {**os.environ, "PYTHONPATH": str(tree)}, tree,
                              cold=True)
                written = du(dst)
                shutil.rmtree(dst)
                cell.walls.append(run.wall)
                cell.cps.append(cp)
                cell.cpu.append(run.cpu)
                cell.rss.append(run.rss)
                print(f"405b {command} {name} --max-memory {budget}: {run.wall:.1f} s, cp -r {cp:.1f} s "
                      f"({run.wall / cp:.2f}x), CPU {run.cpu:.1f} s, peak RSS {run.rss / 2**30:.2f} GiB, "
                      f"load {cell.load[-1]:.1f}", flush=True)
    return cells, written


_WHAT = {"to-nxd": "to-nxd of one Llama-3.1-405B-shaped layer", "to-hf": "to-hf of its NxD shards",
         "reshard": "reshard of its NxD shards to tp 16 kvm 2"}


def _table(command: str, cells: dict[tuple[str, str], Cell], trees: list[tuple[str, Path]], read: int,
           written: int) -> str:
    lines = [f"{_WHAT[command]} ({read / 1e9:.1f} GB read, {written / 1e9:.1f} GB written), the shards tp 32 kvm 4 "
             "QKV linear fused, page cache dropped before each run",
             "",
             "| tree | --max-memory | runs | wall s | cp -r s | ratio to cp | range | CPU s/GB | peak RSS | load |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, _ in trees:
        for budget in BUDGETS:
            cell = cells[name, budget]
            ratios = sorted(w / c for w, c in zip(cell.walls, cell.cps, strict=True))
            lines.append(f"| {name} | {budget} | {len(ratios)} | {statistics.median(cell.walls):.1f} | "
                         f"{statistics.median(cell.cps):.1f} | {statistics.median(ratios):.2f}x | "
                         f"{ratios[0]:.2f}-{ratios[-1]:.2f}x | {statistics.median(cell.cpu) / (written / 1e9):.2f} | "
                         f"{max(cell.rss) / 2**30:.2f} GiB | {min(cell.load):.1f}-{max(cell.load):.1f} |")
    return "\n".join(lines)
