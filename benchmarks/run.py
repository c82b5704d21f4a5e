"""``make bench``: conversion speed against ``cp -r`` of the same input, and peak memory.

Every timed command runs in a fresh process, followed by ``sync`` (so both sides pay for writing
their bytes to disk), after the page cache was dropped when the kernel allows it (so both read from
disk). Each conversion is paired with its own ``cp -r`` right before it, and the headline cases
are repeated (``--repeat``, default 3): the disk is shared and a single pair can be off by 2x.
The table shows medians and the range of the per-pair ratios. Peak RSS is the child's own
``ru_maxrss`` (``os.wait4``). One table is printed at the end and written to
``bench-out/results.md`` and ``.json``.

    python benchmarks/run.py [--quick] [--repeat N]    # --quick: small shapes, for a smoke run
    python benchmarks/run.py --checked-reads [--repeat N] [--layers L]   # to-hf with and without --no-check
    python benchmarks/run.py --only-8b [--repeat N]                      # the 8B rows alone (make bench-8b)
    python benchmarks/run.py --dcp [--repeat N]       # to-dcp (TorchTitan) of the 70B shapes, and from-dcp back
    python benchmarks/run.py --moe [--layers L] [--repeat N]   # Mixtral-8x7B shapes: to-nxd and reshard across ep
    python benchmarks/run.py --moe-cost [--repeat N] [--before DIR] [--torch-transpose]  # MoE vs dense vs cp (47)
    python benchmarks/run.py --deepseek [--experts N] [--repeat N]   # DeepSeek-V3 FP8 -> DCP, and TorchTitan's convert
    python benchmarks/run.py --gpt-oss [--layers L] [--repeat N]   # GPT-OSS-120B shapes, MXFP4: to-dcp
    python benchmarks/run.py --training [--repeat N] [--before DIR]   # the training-state rows alone
    python benchmarks/run.py --405b [--repeat N] [--before DIR] [--405b-commands to-nxd,to-hf,reshard]
                                                                  # Llama-3.1-405B layer shapes at 1, 2, 4 GiB

The training-state rows (reshard in both optimizer formats, to-dcp, from-dcp of a 6.85 GB training tag; marginal
ratios to cp, start-up, CPU s/GB, peak RSS; ``--before DIR``: the same commands from an older tree, in the same run)
are described in ``benchmarks/training_rows.py``; a full run ends with them, after the 405B-shaped rows (one run per
budget; ``benchmarks/llama405b.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deepseek_v3 import deepseek_rows  # noqa: E402
from gpt_oss import gpt_oss_rows  # noqa: E402
from llama405b import llama405b_rows  # noqa: E402
from measure import drop_caches, du, measure  # noqa: E402
from moe import moe_rows  # noqa: E402
from moe_cost import moe_cost_rows  # noqa: E402
from synth import write_model  # noqa: E402
from training_rows import training_rows  # noqa: E402

OUT = Path("bench-out")
CKPTCONV = [sys.executable, "-m", "ckptconv.cli"]
CPU_SECONDS: list[float] = []  # user + system CPU of each timed command, in order


@dataclass
class Row:
    case: str
    runs: list[tuple[float, float]]  # (seconds, cp -r seconds of the same input just before)
    bytes_read: int
    bytes_written: int
    peak_rss: int  # the largest over the runs

    @property
    def seconds(self) -> float:
        return statistics.median(s for s, _ in self.runs)

    @property
    def cp_seconds(self) -> float:
        return statistics.median(c for _, c in self.runs)

    @property
    def ratios(self) -> list[float]:
        return sorted(s / c for s, c in self.runs)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


def timed(argv: list[str]) -> tuple[float, int]:
    """Wall seconds (command + sync, page cache dropped before) and the child's peak RSS in bytes (its CPU seconds
    go to CPU_SECONDS)."""
    run = measure(argv, cold=True)
    CPU_SECONDS.append(run.cpu)
    return run.wall, run.rss


def cp_time(src: Path) -> float:
    target = OUT / "cp-copy"
    shutil.rmtree(target, ignore_errors=True)
    seconds, _ = timed(["cp", "-r", str(src), str(target)])
    shutil.rmtree(target)
    return seconds


def convert(case: str, argv: list[str], src: Path, dst: Path, repeat: int = 1) -> Row:
    runs, peak = [], 0
    for _ in range(repeat):
        shutil.rmtree(dst, ignore_errors=True)
        baseline = cp_time(src)
        seconds, rss = timed([*CKPTCONV, *argv, "--quiet"])
        runs.append((seconds, baseline))
        peak = max(peak, rss)
        print(f"{case}: {seconds:.1f} s, cp -r {baseline:.1f} s ({seconds / baseline:.2f}x)", flush=True)
    return Row(case, runs, du(src), du(dst), peak)


def model(name: str, shape: str, layers: int) -> Path:
    path = OUT / name
    if not (path / "config.json").is_file():
        shutil.rmtree(path, ignore_errors=True)
        print(f"generating {name} ({shape}, {layers} layers) ...", flush=True)
        write_model(path, shape, layers)
    return path


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def table(rows: list[Row], rss_rows: list[tuple[str, int]]) -> str:
    lines = [
        "| case | runs | wall s | cp -r s | ratio to cp | ratio range | read | written | throughput | peak RSS |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        spread = f"{r.ratios[0]:.2f}-{r.ratios[-1]:.2f}x" if len(r.runs) > 1 else ""
        lines.append(f"| {r.case} | {len(r.runs)} | {r.seconds:.1f} | {r.cp_seconds:.1f} | {r.ratio:.2f}x | {spread} | "
                     f"{gb(r.bytes_read)} | {gb(r.bytes_written)} | {(r.bytes_written or r.bytes_read) / r.seconds / 1e6:.0f} MB/s | "
                     f"{r.peak_rss / 2**20:.0f} MiB |")
    if rss_rows:
        lines += ["", "| peak RSS, to-nxd with default settings | MiB |", "| --- | ---: |"]
        lines += [f"| {case} | {rss / 2**20:.0f} |" for case, rss in rss_rows]
        growth = (rss_rows[-1][1] - rss_rows[0][1]) / rss_rows[0][1] * 100
        lines.append(f"| growth from {rss_rows[0][0]} to {rss_rows[-1][0]} | {growth:+.1f}% |")
    return "\n".join(lines)


def checked_reads(repeat: int, layers: int) -> None:
    """The cost of checked reads: to-hf of the 70B-shaped tp 32 pp 2 case with checks (the default) and
    with --no-check, alternating which goes first, each paired with its own cp -r of the input."""
    started = time.perf_counter()
    nxd = OUT / f"nxd-70b-{layers}l-checked"
    if not (nxd / "ckptconv.json").is_file():
        hf = model(f"hf-70b-{layers}l", "70b", layers)
        shutil.rmtree(nxd, ignore_errors=True)
        subprocess.run([*CKPTCONV, "to-nxd", str(hf), str(nxd), "--tp", "32", "--pp", "2", "--qkv-linear", "--fuse-qkv",
                        "--kv-size-multiplier", "4", "--xser", "--quiet"], check=True)
        shutil.rmtree(hf)  # only the shards are needed from here on: less disk in use
    back = OUT / "hf-back-checked"
    label = f"to-hf 70b x{layers} layers from tp 32 pp 2"
    variants = {f"{label}, checked reads": [], f"{label}, --no-check": ["--no-check"]}
    rows = {case: Row(case, [], 0, 0, 0) for case in variants}
    cpu: dict[str, list[float]] = {case: [] for case in variants}
    for i in range(repeat):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for case in order:
            row = convert(case, ["to-hf", str(nxd), str(back), *variants[case]], nxd, back)
            cpu[case].append(CPU_SECONDS[-1])
            rows[case].runs += row.runs
            rows[case].bytes_read, rows[case].bytes_written = row.bytes_read, row.bytes_written
            rows[case].peak_rss = max(rows[case].peak_rss, row.peak_rss)
            shutil.rmtree(back)
    checked, unchecked = rows.values()
    cost = sorted(c[0] / u[0] for c, u in zip(checked.runs, unchecked.runs, strict=True))
    text = table(list(rows.values()), []) + (
        f"\n\nchecked / --no-check, paired by repetition: median {statistics.median(cost):.3f}x, "
        f"range {cost[0]:.3f}-{cost[-1]:.3f}x over {len(cost)} pairs; CPU seconds (user + system) median "
        + ", ".join(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) {case.rsplit(', ', 1)[1]}"
                    for case, v in cpu.items()))
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    print(f"\n{text}\n\nmachine: {machine}; page cache dropped before each run: {drop_caches()}; "
          f"total {time.perf_counter() - started:.0f} s")
    (OUT / "checked-reads.md").write_text(text + "\n")


def dcp_rows(hf: Path, label: str, repeat: int) -> list[Row]:
    """to-dcp of an HF model (TorchTitan's layout: q/k rows permuted), and from-dcp of that back to HF."""
    dcp, back = OUT / "dcp", OUT / "hf-back-dcp"
    rows = [convert(f"to-dcp {label}", ["to-dcp", str(hf), str(dcp)], hf, dcp, repeat)]
    rows.append(convert(f"from-dcp {label} to hf", ["from-dcp", str(dcp), str(back)], dcp, back, repeat))
    shutil.rmtree(back)
    shutil.rmtree(dcp)
    return rows


def dcp_only(repeat: int) -> None:
    started = time.perf_counter()
    hf = model("hf-70b-4l", "70b", 4)
    text = table(dcp_rows(hf, "70b x4 layers", repeat), [])
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    print(f"\n{text}\n\nmachine: {machine}; page cache dropped before each run: {drop_caches()}; "
          f"total {time.perf_counter() - started:.0f} s")
    (OUT / "dcp.md").write_text(text + "\n")


def diff_row(case: str, a: Path, b: Path, repeat: int = 1) -> Row:
    """``ckptconv diff A B`` against ``cp -r`` of both folders (what it reads), each run right after its cp."""
    runs, peak = [], 0
    for _ in range(repeat):
        baseline = cp_time(a) + cp_time(b)
        seconds, rss = timed([*CKPTCONV, "diff", str(a), str(b), "--quiet"])
        runs.append((seconds, baseline))
        peak = max(peak, rss)
        print(f"{case}: {seconds:.1f} s, cp -r of both {baseline:.1f} s ({seconds / baseline:.2f}x)", flush=True)
    return Row(case, runs, du(a) + du(b), 0, peak)


def diff_rows(small: str, layers: int, repeat: int) -> list[Row]:
    """diff of NxD shards (tp 8 pp 2) against their TorchTitan DCP, 8B layer shapes."""
    hf = model(f"hf-{small}-{layers}l", small, layers)
    nxd, dcp = OUT / f"nxd-{small}-diff", OUT / f"dcp-{small}-diff"
    for argv in (["to-nxd", str(hf), str(nxd), "--tp", "8", "--pp", "2", "--qkv-linear"], ["to-dcp", str(nxd), str(dcp)]):
        if subprocess.run([*CKPTCONV, *argv, "--quiet"], stdout=subprocess.DEVNULL).returncode != 0:
            raise SystemExit(f"bench: {' '.join(argv)} failed")
    row = diff_row(f"diff {small} x{layers} layers: tp 8 pp 2 shards vs their DCP", nxd, dcp, repeat)
    shutil.rmtree(nxd)
    shutil.rmtree(dcp)
    return [row]


def small_rows(small: str, layers: int, repeat: int) -> list[Row]:
    """The 8B rows: to-nxd tp 8 pp 2, to-hf back, reshard to tp 4 pp 1; diff of the shards against their DCP."""
    rows = []
    l8 = model(f"hf-{small}-{layers}l", small, layers)
    nxd8 = OUT / f"nxd-{small}"
    rows.append(convert(f"to-nxd {small}: tp 8 pp 2 qkv", ["to-nxd", str(l8), str(nxd8), "--tp", "8", "--pp", "2",
                                                           "--qkv-linear"], l8, nxd8, repeat))
    back8 = OUT / f"hf-back-{small}"
    rows.append(convert(f"to-hf {small} from tp 8 pp 2", ["to-hf", str(nxd8), str(back8)], nxd8, back8, repeat))
    shutil.rmtree(back8)
    resharded = OUT / f"nxd-{small}-tp4"
    rows.append(convert(f"reshard {small}: tp 8 pp 2 -> tp 4 pp 1", ["reshard", str(nxd8), str(resharded), "--tp", "4",
                                                                     "--pp", "1"], nxd8, resharded, repeat))
    shutil.rmtree(resharded)
    shutil.rmtree(nxd8)
    rows += diff_rows(small, layers, repeat)
    shutil.rmtree(l8)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small models: a smoke run of the harness")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each 70B case (median reported)")
    parser.add_argument("--checked-reads", action="store_true",
                        help="only the cost of checked reads: to-hf of the 70B case with and without --no-check")
    parser.add_argument("--layers", type=int, default=2, help="layers of the 70B model for --checked-reads, of the Mixtral model for --moe")
    parser.add_argument("--dcp", action="store_true", help="only to-dcp / from-dcp of the 70B shapes (4 layers)")
    parser.add_argument("--only-8b", action="store_true", help="only the 8B rows, each run --repeat times")
    parser.add_argument("--diff", action="store_true", help="only the diff row (8B shapes, --layers layers)")
    parser.add_argument("--moe", action="store_true", help="only the Mixtral-8x7B-shaped rows (--layers layers)")
    parser.add_argument("--moe-cost", action="store_true",
                        help="only the MoE rows against a dense model and cp of the same bytes (issue 47; --before)")
    parser.add_argument("--torch-transpose", action="store_true",
                        help="--moe-cost: also run each MoE command with CKPTCONV_NATIVE=0 (torch's transpose, not ckptconv's kernel)")
    parser.add_argument("--training", action="store_true", help="only the training-state rows (6.85 GB tag)")
    parser.add_argument("--deepseek", action="store_true", help="only the DeepSeek-V3 rows (FP8 671B layer shapes)")
    parser.add_argument("--experts", type=int, default=256, help="routed experts of the DeepSeek-V3 rows")
    parser.add_argument("--titan-limit", type=int, default=16 * 2**30,
                        help="address-space limit (bytes) of TorchTitan's convert_from_hf in the DeepSeek-V3 rows")
    parser.add_argument("--gpt-oss", action="store_true", help="only the GPT-OSS-120B-shaped MXFP4 to-dcp row")
    parser.add_argument("--405b", dest="llama405b", action="store_true",
                        help="only the Llama-3.1-405B-shaped layer at --max-memory 1, 2 and 4 GiB (--repeat times)")
    parser.add_argument("--405b-commands", dest="commands_405b", default="to-nxd",
                        help="the 405B rows' commands, comma-separated, of to-nxd, to-hf, reshard (default to-nxd)")
    parser.add_argument("--before", type=Path, default=None,
                        help="training-state, --moe-cost and 405B rows: also run each command from this older source tree")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    if args.moe:
        moe, notes = moe_rows(OUT, convert, CPU_SECONDS, args.layers, args.repeat)
        print(text := table(moe, []) + "\n\n" + "\n".join(notes))
        (OUT / "moe.md").write_text(text + "\n")
        return
    if args.moe_cost:
        text = moe_cost_rows(OUT, args.repeat, args.before, args.torch_transpose)
        print(f"\n{text}")
        (OUT / "moe-cost.md").write_text(text)
        return
    if args.deepseek:
        rows, notes = deepseek_rows(OUT, convert, CPU_SECONDS, args.experts, args.repeat, args.titan_limit)
        print(text := table(rows, []) + "\n\n" + "\n".join(notes))
        (OUT / "deepseek.md").write_text(text + "\n")
        return
    if args.gpt_oss:
        rows, notes = gpt_oss_rows(OUT, convert, CPU_SECONDS, args.layers, args.repeat)
        print(text := table(rows, []) + "\n\n" + "\n".join(notes))
        (OUT / "gpt_oss.md").write_text(text + "\n")
        return
    if args.llama405b:
        text = llama405b_rows(OUT, args.repeat, args.before, tuple(args.commands_405b.split(",")))
        print(f"\n{text}")
        (OUT / "llama405b.md").write_text(text + "\n")
        return
    if args.training:
        text = training_rows(OUT, args.repeat, args.before)
        print(f"\n{text}")
        (OUT / "training.md").write_text(text)
        return
    if args.only_8b:
        started = time.perf_counter()
        text = table(small_rows("8b", 8, args.repeat), [])
        print(f"\n{text}\n\npage cache dropped before each run: {drop_caches()}; total "
              f"{time.perf_counter() - started:.0f} s")
        (OUT / "results-8b.md").write_text(text + "\n")
        return
    if args.checked_reads:
        checked_reads(args.repeat, args.layers)
        return
    if args.diff:
        rows = diff_rows("8b", args.layers, args.repeat)
        shutil.rmtree(OUT / f"hf-8b-{args.layers}l")
        print(text := table(rows, []) + f"\n\npage cache dropped before each run: {drop_caches()}")
        (OUT / "diff.md").write_text(text + "\n")
        return
    if args.dcp:
        dcp_only(args.repeat)
        return
    started = time.perf_counter()
    big, small = ("8b", "8b") if args.quick else ("70b", "8b")
    layers = 2 if args.quick else 4
    rows: list[Row] = []

    l70 = model(f"hf-{big}-{layers}l", big, layers)
    tp_big = 8 if args.quick else 32
    nxd70 = OUT / f"nxd-{big}"
    to_nxd_70 = ["to-nxd", str(l70), str(nxd70), "--tp", str(tp_big), "--pp", "2", "--qkv-linear", "--fuse-qkv",
                 "--kv-size-multiplier", str(tp_big // 8), "--xser"]
    label = f"to-nxd {big} x{layers} layers: tp {tp_big} pp 2 kvm {tp_big // 8} qkv fused xser"
    rows.append(convert(label, to_nxd_70, l70, nxd70, args.repeat))
    back70 = OUT / f"hf-back-{big}"
    to_hf_70 = ["to-hf", str(nxd70), str(back70)]
    rows.append(convert(f"to-hf {big} from tp {tp_big} pp 2", to_hf_70, nxd70, back70, args.repeat))
    shutil.rmtree(back70)
    shutil.rmtree(nxd70)
    rows += dcp_rows(l70, f"{big} x{layers} layers", args.repeat)

    # --quick: 3 layers, not 2: the 8B rows delete their model, which at 2 layers is the --quick big model (pp 2: >= 2)
    rows += small_rows(small, 3 if args.quick else 8, repeat=1)
    rows += moe_rows(OUT, convert, CPU_SECONDS, 1 if args.quick else 2, repeat=1)[0]
    deepseek, deepseek_notes = deepseek_rows(OUT, convert, CPU_SECONDS, 16 if args.quick else args.experts, 1,
                                             args.titan_limit)
    rows += deepseek
    rows += gpt_oss_rows(OUT, convert, CPU_SECONDS, 1 if args.quick else 2, repeat=1)[0]

    rss_rows: list[tuple[str, int]] = []
    for n_layers in ((2, 4) if args.quick else (2, 8)):
        src = l70 if n_layers == layers else model(f"hf-{big}-{n_layers}l", big, n_layers)
        dst = OUT / "nxd-rss"
        shutil.rmtree(dst, ignore_errors=True)
        _, rss = timed([*CKPTCONV, "to-nxd", str(src), str(dst), "--tp", str(tp_big), "--pp", "2", "--qkv-linear",
                        "--fuse-qkv", "--kv-size-multiplier", str(tp_big // 8), "--quiet"])
        rss_rows.append((f"{big} x{n_layers} layers", rss))
        shutil.rmtree(dst)
        if src != l70:
            shutil.rmtree(src)
    shutil.rmtree(l70)

    big405 = "" if args.quick else llama405b_rows(OUT, 1, args.before) + "\n\n"  # 14.8 GB in, once per budget
    text = (table(rows, rss_rows) + "\n\n" + "\n".join(deepseek_notes) + "\n\n" + big405
            + training_rows(OUT, args.repeat, args.before))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM"
    print(f"\n{text}\n\nmachine: {machine}; page cache dropped before each run: {drop_caches()}; "
          f"total {time.perf_counter() - started:.0f} s")
    (OUT / "results.md").write_text(text + f"\n\nmachine: {machine}; total {time.perf_counter() - started:.0f} s\n")
    (OUT / "results.json").write_text(json.dumps({"rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
                                                  "rss": rss_rows, "machine": machine}, indent=1))


if __name__ == "__main__":
    main()
