"""The Llama-3.1-405B-shaped rows of ``make bench`` (``make bench-405b``: 3 repeats, ``--before DIR`` for the same
commands from an older tree in the same run).

One 405B-shaped decoder layer (hidden 16384, ffn 53248, 128 query heads, 8 K/V heads, vocab 128256: 14.8 GB bf16,
single matrices of 0.54-1.74 GB, a 4.2 GB embedding and lm_head) to NxD at tp 32, kvm 4, QKV linear (o_proj
column-major), fused QKV, at ``--max-memory`` 1, 2 (the default) and 4 GiB. Each budget's runs (after, then before
when given) follow one ``cp -r`` of the input, and every ratio is to that copy; the page cache is dropped before each
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


def _to_nxd(src: Path, dst: Path, budget: str) -> list[str]:
    return [sys.executable, "-m", "ckptconv.cli", "to-nxd", str(src), str(dst), "--tp", "32", "--qkv-linear",
            "--fuse-qkv", "--kv-size-multiplier", "4", "--max-memory", budget, "--quiet"]


def llama405b_rows(out: Path, repeat: int, before: Path | None) -> str:
    """Generate the layer under ``out``, run every budget ``repeat`` times (alternating the trees), delete what was
    written; the table (markdown)."""
    out = out.resolve()
    src, dst, copy = out / "hf-405b-1l", out / "nxd-405b", out / "cp-405b"
    if not (src / "config.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        print("generating hf-405b-1l (Llama-3.1-405B shapes, 1 layer, 14.8 GB) ...", flush=True)
        write_model(src, "405b", 1)
    trees = [("after", REPO)] + ([("before", before.resolve())] if before else [])
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
                run = measure(_to_nxd(src, dst, budget), {**os.environ, "PYTHONPATH": str(tree)}, tree,
                              cold=True)
                written = du(dst)
                shutil.rmtree(dst)
                cell.walls.append(run.wall)
                cell.cps.append(cp)
                cell.cpu.append(run.cpu)
                cell.rss.append(run.rss)
                print(f"405b {name} --max-memory {budget}: {run.wall:.1f} s, cp -r {cp:.1f} s "
                      f"({run.wall / cp:.2f}x), CPU {run.cpu:.1f} s, peak RSS {run.rss / 2**30:.2f} GiB, "
                      f"load {cell.load[-1]:.1f}", flush=True)
    read = du(src)
    shutil.rmtree(src)
    return _table(cells, trees, read, written)


def _table(cells: dict[tuple[str, str], Cell], trees: list[tuple[str, Path]], read: int, written: int) -> str:
    lines = [f"to-nxd of one Llama-3.1-405B-shaped layer ({read / 1e9:.1f} GB read, {written / 1e9:.1f} GB written), "
             "tp 32 kvm 4 QKV linear fused, page cache dropped before each run",
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
