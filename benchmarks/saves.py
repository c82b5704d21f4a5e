"""``make bench-train``'s save table: how long an nxdtrain save stalls training, against ``cp -r`` of the tag's bytes.

The models of ``benchmarks/train.py`` (dense Llama: 8 layers, hidden 512, fp32, AdamW) and ``benchmarks/train_moe.py``
(Mixtral: 4 layers, hidden 256, 8 experts), built once. Each row trains a step and then saves, ``--saves`` times, in
a fresh world of forkserver processes (as ``nxdtrain run --nproc``); rows: ``dense`` (1 process), ``zero1`` (dp 2,
``--zero1``), ``fsdp`` (dp 2, ``--shard-params``), ``ep2`` (the Mixtral at dp 2, ep 2).

``stall`` is the wall time of ``Trainer.save`` on rank 0, which returns after every rank's files, ``ckptconv.json``
and the markers are written (its last barrier): the time training stops for a save. Right after each save rank 0
reads the tag once (so its pages are cached whatever path wrote them) and times ``cp -r`` of it into ``copies/``
(kept, as the tags are, until the row ends: :func:`copy_cost`): ``ratio`` is stall / cp of the same bytes in the same process, minutes apart at most. Where
the stall goes is split by timing the save's stages on rank 0 (``PHASES``: the FSDP gather, the model shard's and the
optimizer files' writes, the digests read back, ckptconv.json and markers); what a stage does not exist for in a tree
is left out, and nothing is fsynced (neither writer syncs).

``--modes sync,async`` (the default) runs each row twice in turn, the second time with ``--async-save``: its stall is
``save`` (the collectives and the host copy, where there is one) plus ``fence`` (on the CPU, where the thread writes
the live state: how long the next step's optimizer waited for the writes) plus the completion after the next step
(``wait``: for the background thread's writes when one step was shorter than they were, then the records' gather, the
FSDP files' ``seal``, ``ckptconv.json``, the markers); ``next step s`` is the step that ran beside the writes (in sync
rows, the step after the save), ``thread`` what the background thread spent writing.

``--tree DIR`` (repeatable) runs every row with ``PYTHONPATH=DIR``: ``--tree`` a checkout of the branch point then
this tree measures before and after, alternated row by row, ``--repeat`` times. Written to ``bench-out/saves.md``
and ``.json``; the machine's load (``os.getloadavg``) is printed with each row.

    python benchmarks/saves.py [--quick] [--saves 3] [--repeat 1] [--tree /tmp/before --tree .] [--rows dense,fsdp]
                               [--modes sync,async]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = Path("bench-out")
ROWS: dict[str, tuple[str, int, dict[str, Any]]] = {  # name: (model, processes, nxdtrain options)
    "dense": ("llama", 1, {}),
    "zero1": ("llama", 2, {"zero1": True}),
    "fsdp": ("llama", 2, {"shard_params": True}),
    "ep2": ("mixtral", 2, {"ep": 2}),
}
# (module, attribute, stage): what is timed of a save, where a tree has it (the names of before and after)
PHASES = (
    ("nxdtrain.parallel.fsdp", "Sharding.gathered", "gather"),
    ("nxdtrain.checkpoint.save", "to_host", "gather"),
    ("nxdtrain.checkpoint.save", "save_shard", "model"),
    ("nxdtrain.checkpoint.save", "save_torch", "optim"),
    ("nxdtrain.checkpoint.save", "save_state", "optim"),
    ("nxdtrain.checkpoint.save", "state_to_save", "gather"),
    ("nxdtrain.checkpoint.save", "HostCopies.copy", "copy"),
    ("nxdtrain.checkpoint.save", "file_records", "digests"),
    ("nxdtrain.checkpoint.save", "finish_tag", "finish"),
    ("nxdtrain.checkpoint.shared", "build", "plan"),          # FSDP without a gather: files planned and created,
    ("nxdtrain.checkpoint.shared", "SharedFile.write", "rows"),  # each rank's rows written,
    ("nxdtrain.checkpoint.shared", "SharedSave.seal", "seal"),  # the CRCs exchanged; the owner's descriptors, digest
)


# ------------------------------------------------------------------ inside each rank


class Timers:
    """Seconds spent in each stage of PHASES (outermost call of each thread only: a stage inside another counts once;
    stages on two threads at once both count, so they may add up to more than the stall)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._depth = threading.local()
        self._lock = threading.Lock()

    def install(self) -> None:
        for module, attr, stage in PHASES:
            try:
                owner: Any = importlib.import_module(module)
            except ModuleNotFoundError:  # a tree without it (before the gather-free FSDP save)
                continue
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part, None)
            if owner is not None and hasattr(owner, name):
                setattr(owner, name, self._timed(getattr(owner, name), stage))

    def _timed(self, fn: Any, stage: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._depth, "n", 0):
                return fn(*args, **kwargs)
            self._depth.n = 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = 0
                with self._lock:
                    self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - started

        return timed

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def save_worker(options: dict[str, Any], saves: int, out: Path, background: bool) -> None:
    """One rank: a Trainer as ``nxdtrain.train.train`` builds it; ``saves`` times a step, then a timed save. With
    ``background`` (``--async-save``) a save's stall is its ``save`` (the host copy) plus its completion after the
    next step (``finish_save``: any wait for the thread's writes, the records' gather, ckptconv.json, markers); what
    the thread spent writing is ``thread``, and ``step`` is the time of the step that ran beside it."""
    import torch
    import torch.distributed as dist

    from nxdtrain.config.options import TrainConfig
    from nxdtrain.parallel.dist import detect_env, init_world, local_world_size
    from nxdtrain.train import Trainer, prepare

    config = TrainConfig.from_flat(options)
    env = detect_env()
    plan = prepare(config, env.world_size)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size()))
    device = init_world(env, config.dist_timeout, plan.device)
    timers = Timers()
    timers.install()
    rows: list[dict[str, Any]] = []
    tag = Path()
    try:
        trainer = Trainer(plan, device)
        for index in range(saves + 1):  # the last step: the one beside the last save's writes
            started = time.perf_counter()
            trainer.train_step(index + 1)
            if rows:
                rows[-1]["step"] = time.perf_counter() - started
                fenced = getattr(trainer.writer, "fenced_s", 0.0)  # the step waited for the writes of live state
                if background:
                    rows[-1]["stall"] += fenced
                    rows[-1]["phases"]["fence"] = fenced
            dist.barrier()
            if background and rows:
                rows[-1]["phases"]["thread"] = sum(timers.take().values())
                started = time.perf_counter()
                assert trainer.writer is not None
                waited = trainer.writer.complete()  # finish_save's work, less its note
                rows[-1]["stall"] += time.perf_counter() - started
                rows[-1]["phases"].update(timers.take(), wait=waited)
                if env.rank == 0:
                    rows[-1].update(copy_cost(tag))
                dist.barrier()
            if index == saves:
                break
            timers.take()
            started = time.perf_counter()
            tag = trainer.save(background=True) if background else trainer.save()
            stall = time.perf_counter() - started
            row: dict[str, Any] = {"stall": stall, "phases": timers.take()}
            if env.rank == 0 and not background:
                row.update(copy_cost(tag))
            rows.append(row)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    (out / f"rank{env.rank}.json").write_text(json.dumps(rows))


def copy_cost(tag: Path) -> dict[str, Any]:
    """``cp -r`` of ``tag`` from cached pages (read once first) into ``copies/`` beside the checkpoint directory,
    timed; and its bytes. The copy stays until the row ends, as the tags do: each cp, like each save, then writes
    into page-cache pages nobody freed a moment before (on this VM a page the host took back costs ~2 CPU s/GB at
    first touch, to any writer: large writes take such pages first, docs/performance.md's "Buffered writes in
    128 KiB pieces"; a copy deleted right away would hand its pages to the next cp, never to the next save)."""
    files = [p for p in tag.rglob("*") if p.is_file()]
    for path in files:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass
    copies = tag.parent.parent / "copies"
    copies.mkdir(exist_ok=True)
    started = time.perf_counter()
    subprocess.run(["cp", "-r", str(tag), str(copies / tag.name)], check=True)
    cp = time.perf_counter() - started
    return {"cp": cp, "bytes": sum(p.stat().st_size for p in files)}


def run_one(row: str, source: str, saves: int, quick: bool, out: Path, background: bool, seq: int | None) -> int:
    """One row in this process's tree (``--one``): the world, then rank 0's records in ``out/result.json``."""
    from nxdtrain.cli import PRELOAD
    from nxdtrain.parallel.dist import spawn

    model, procs, extra = ROWS[row]
    seq = seq or (64 if quick else (512 if model == "llama" else 256))
    options = dict(precision="fp32", data="synthetic", seq_len=seq, gbs=4 if quick else 8, mbs=1 if quick else 2,
                   steps=saves + 1, lr=1e-4, warmup=0, schedule="constant", optimizer="adamw", weight_decay=0.1,
                   clip_grad=1.0, seed=1, dist_timeout=600.0, resume=source, checkpoint_dir=str(out / "ckpt"),
                   keep=saves + 1, **extra)
    code = spawn(save_worker, (options, saves, out, background), procs, timeout_s=1800, preload=PRELOAD)
    if code:
        return code
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(procs)]
    merged = [{**ranks[0][i], "stall": max(r[i]["stall"] for r in ranks)} for i in range(saves)]
    (out / "result.json").write_text(json.dumps(merged))
    return 0


# ------------------------------------------------------------------ the launcher


def build(root: Path, quick: bool) -> dict[str, Path]:
    """The two NxD checkpoints the rows resume from (in this tree: the bytes are the same for every tree)."""
    sys.path.append(str(HERE.parent))  # after PYTHONPATH: benchmarks/ helpers only
    from benchmarks.train import QUICK, Shape, build_model, converted
    from benchmarks.train_moe import build as build_moe

    llama = converted(build_model(root / "llama", QUICK if quick else Shape()), root / "llama", 1, 1)
    moe = argparse.Namespace(hidden=128 if quick else 256, layers=2 if quick else 4, seq=64 if quick else 256)
    (root / "mixtral").mkdir()
    return {"llama": llama, "mixtral": build_moe(root / "mixtral", moe)}


def measure_row(tree: Path, row: str, source: Path, args: argparse.Namespace, out: Path,
                mode: str) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, str(Path(__file__).resolve()), "--one", row, "--source", str(source), "--out", str(out),
            "--saves", str(args.saves), "--seq", str(args.seq or 0)] + (["--quick"] if args.quick else []) + (["--async"] if mode == "async" else [])
    # cwd out of every tree: the forkserver (python -c) puts its working directory first on sys.path
    subprocess.run(argv, env=env, check=True, cwd=out)
    result: list[dict[str, Any]] = json.loads((out / "result.json").read_text())
    shutil.rmtree(out / "ckpt")
    shutil.rmtree(out / "copies", ignore_errors=True)
    return result


def summary(label: str, row: str, mode: str, saves: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the saves after the first (the first also builds what later ones reuse: reported apart)."""
    later = saves[1:] or saves
    stages = sorted({k for s in later for k in s["phases"]})
    return {
        "tree": label, "row": row, "mode": mode, "step": statistics.median(s.get("step", 0.0) for s in later),
        "bytes": saves[0]["bytes"], "first_stall": saves[0]["stall"],
        "stall": statistics.median(s["stall"] for s in later), "cp": statistics.median(s["cp"] for s in later),
        "ratio": statistics.median(s["stall"] / s["cp"] for s in later),
        "phases": {k: statistics.median(s["phases"].get(k, 0.0) for s in later) for k in stages},
        "load": os.getloadavg()[0],
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| row | tree | save | tag MB | stall s (first) | cp -r s | stall / cp | next step s | stages s | load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
        lines.append(f"| {r['row']} | {r['tree']} | {r['mode']} | {r['bytes'] / 1e6:.0f} | {r['stall']:.2f} "
                     f"({r['first_stall']:.2f}) | {r['cp']:.2f} | {r['ratio']:.2f}x | {r['step']:.2f} | {stages} | "
                     f"{r['load']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke check")
    parser.add_argument("--saves", type=int, default=3, help="saves per row (the first reported apart)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every row and tree, alternated")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated of {', '.join(ROWS)}")
    parser.add_argument("--tree", action="append", default=[], help="a checkout to measure (default: this one)")
    parser.add_argument("--seq", type=int, default=None, help="training rows' length (default 512 dense, 256 "
                        "Mixtral; shorter steps, the same tag)")
    parser.add_argument("--modes", default="sync,async", help="sync, async (--async-save) or both, alternated")
    parser.add_argument("--async", dest="background", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help="where models and tags go (default: a temporary directory)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--source", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return run_one(args.one, args.source, args.saves, args.quick, Path(args.out), args.background, args.seq)
    trees = [Path(t).resolve() for t in args.tree] or [HERE.parent]
    rows = args.rows.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-saves-", dir=args.workdir) as tmp:
        root = Path(tmp)
        sources = build(root, args.quick)
        for round_ in range(args.repeat):
            for row in rows:
                for n, tree in enumerate(trees):
                    for mode in args.modes.split(","):
                        saves = measure_row(tree, row, sources[ROWS[row][0]], args,
                                            root / f"{row}-{n}-{mode}-{round_}", mode)
                        results.append(summary(str(tree), row, mode, saves))
                        print(table(results[-1:]).splitlines()[-1], flush=True)
    text = table(results)
    print("\n" + text)
    OUT.mkdir(exist_ok=True)
    (OUT / "saves.md").write_text(text)
    (OUT / "saves.json").write_text(json.dumps({"args": vars(args), "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
