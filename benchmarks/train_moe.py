"""``make bench-train``'s MoE table: nxdtrain on a Mixtral at ep 1 and ep 2 in the same world, in one run.

A random Mixtral scaled to a small machine (default: 4 layers, hidden 256, 8 heads, 2 K/V heads, 8 experts of
intermediate 512, top-2, vocab 4096, seq 256, fp32) is saved once and converted; each row trains ``--warmup`` and
then ``--steps`` timed steps of the same global batch in 2 forkserver processes (dp 2; at ep 2 each dp rank holds 4
experts and the tokens travel by all-to-all), AdamW, aux coefficient 0.02. Reported: tokens/s of the world (median
step), the largest per-rank peak RSS (VmHWM, as benchmarks/train.py measures it) and the bytes each rank sends to
other ep ranks per step by all-to-all, forward and backward (``nxdtrain.parallel.experts.Traffic``). Written to
``bench-out/train-moe.md`` and ``.json``.

A second table (``--table trainers``) races the trainers a user would pick instead on a random Qwen3-MoE (4 layers,
hidden 256, 8 heads, 2 K/V heads, 8 experts of intermediate 512, top-2, vocab 4096; seq 256, a global batch of 8
rows, one micro-batch per rank; fp32, AdamW): nxdtrain, TorchTitan 0.3.0's own trainer (``Trainer.train()`` of the
``torchtitan_config.py`` that ``ckptconv to-dcp`` writes, with the TorchTitan lane's CPU shims:
tests/titan_train_bench.py, run by the TorchTitan venv's python; "skipped" without one) and a transformers
``Qwen3MoeForCausalLM`` loop (router aux loss on), in one process and in a 2-process world (nxdtrain dp 2 x ep 2; TorchTitan
data parallel 2 by DDP: its FSDP and its ep fail in gloo on CPU, tests/titan_train_bench.py; the transformers loop
by torch's DDP over gloo, each rank half the global batch), every trainer on glibc's default allocator (``--malloc
return``: benchmarks/train.py's 64 KiB mmap threshold, which page-faults every reallocation). ``--before DIR`` adds
nxdtrain rows of another tree (main at a branch point). Every row runs in fresh processes, the rows alternated, ``--repeats`` times;
tokens/s is the median step's, the table the median over repeats.

    python benchmarks/train_moe.py [--quick] [--steps 3] [--seq 256] [--table ep|trainers|all] [--before DIR]
        [--worlds 1,2] [--threads N] [--malloc glibc|return]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: ckptconv, nxdtrain, benchmarks

from benchmarks.train import (  # noqa: E402  (sets MALLOC_MMAP_THRESHOLD_)
    GLIBC_MALLOC_ENV,
    MMAP_ENV,
    OUT,
    THREADS_ENV,
    collect,
    hf_worker,
    nxd_worker,
)

REPO = Path(__file__).resolve().parent.parent
VOCAB = 4096


def moe_worker(options: dict[str, Any], steps: int, warmup: int, out: Path) -> None:
    """benchmarks/train.py's worker, then this rank's all-to-all bytes per step added to its record."""
    from nxdtrain.parallel.dist import detect_env
    from nxdtrain.parallel.experts import Traffic

    nxd_worker(options, steps, warmup, out)
    path = out / f"rank{detect_env().rank}.json"
    data = json.loads(path.read_text())
    data["a2a_bytes_per_step"] = Traffic.sent / (steps + warmup)
    path.write_text(json.dumps(data))


def build(root: Path, args: argparse.Namespace) -> Path:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from ckptconv.commands.api import RunOptions, to_nxd

    hf, nxd = root / "hf", root / "nxd"
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=args.hidden, num_attention_heads=8, num_key_value_heads=2,
                           intermediate_size=2 * args.hidden, num_local_experts=8, num_experts_per_tok=2,
                           num_hidden_layers=args.layers, vocab_size=4096, max_position_embeddings=max(2048, args.seq),
                           router_aux_loss_coef=0.02, tie_word_embeddings=False)
    MixtralForCausalLM(config).save_pretrained(hf)
    to_nxd(hf, nxd, options=RunOptions(quiet=True, part=(0, 1)))
    return nxd


def ep_table(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]], list[str]]:
    """The ep 1 / ep 2 table of a Mixtral in a 2-process world."""
    from nxdtrain.cli import PRELOAD
    from nxdtrain.parallel.dist import spawn

    rows, failed = [], []
    with tempfile.TemporaryDirectory(prefix="bench-train-moe-") as tmp:
        root = Path(tmp)
        src = build(root, args)
        for ep in (1, 2):
            out = root / f"out-ep{ep}"
            out.mkdir()
            options = {**nxd_options(args, src, args.mbs), "ep": ep}
            code = spawn(moe_worker, (options, args.steps, args.warmup, out), 2, timeout_s=args.timeout,
                         preload=PRELOAD)
            if code != 0:
                failed.append(f"ep{ep}")
                continue
            result = collect(out, 2, f"ep{ep}", "none", args.gbs * args.seq, 0.0, None)
            sent = max(json.loads((out / f"rank{r}.json").read_text())["a2a_bytes_per_step"] for r in range(2))
            rows.append({**asdict(result), "a2a_mib_per_step": sent / 2**20})
            print(f"ep {ep}: {result.tokens_per_s:8.0f} tok/s  peak {result.peak_mib:6.0f} MiB/rank  "
                  f"all-to-all {sent / 2**20:7.2f} MiB/rank/step", flush=True)
    lines = ["| row | tokens/s | peak MiB per rank | all-to-all MiB per rank per step |", "| --- | --- | --- | --- |"]
    lines += [f"| dp 2, ep {r['row'][2:]} | {r['tokens_per_s']:.0f} | {r['peak_mib']:.0f} | {r['a2a_mib_per_step']:.2f} |"
              for r in rows]
    text = (f"Mixtral {args.layers} layers, hidden {args.hidden}, 8 experts top-2, seq {args.seq}, gbs {args.gbs}, "
            f"mbs {args.mbs}, fp32, 2 processes\n\n" + "\n".join(lines) + "\n")
    return text, rows, failed


def nxd_options(args: argparse.Namespace, src: Path, mbs: int) -> dict[str, Any]:
    return dict(precision="fp32", data="synthetic", seq_len=args.seq, gbs=args.gbs, mbs=mbs,
                steps=args.warmup + args.steps, lr=1e-4, warmup=0, schedule="constant", optimizer="adamw",
                weight_decay=0.1, clip_grad=1.0, seed=1, dist_timeout=600.0, no_checkpoint=True, resume=str(src))


# ------------------------------------------------------------------ the trainers table


def build_qwen3(root: Path, args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """The random Qwen3-MoE in HF form, NxD form (nxdtrain) and DCP form with its torchtitan_config.py."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import ckptconv
    from ckptconv.commands.api import RunOptions, to_nxd

    hf, nxd, dcp = root / "qwen3-hf", root / "qwen3-nxd", root / "qwen3-dcp"
    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            moe_intermediate_size=2 * args.hidden, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=args.hidden // 8, vocab_size=VOCAB, max_position_embeddings=max(2048, args.seq),
                            router_aux_loss_coef=0.02, norm_topk_prob=True, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).save_pretrained(hf)
    to_nxd(hf, nxd, options=RunOptions(quiet=True, part=(0, 1)))
    ckptconv.to_dcp(hf, dcp, options=RunOptions(quiet=True))
    return hf, nxd, dcp


def one_row(args: argparse.Namespace) -> int:
    """``--one KIND``: one row of the trainers table in this process's world; its step times to ``--one-out``."""
    if args.tree:  # nxdtrain of another tree (--before); the forkserver's children inherit sys.path
        sys.path.insert(0, args.tree)
    import nxdtrain
    from nxdtrain.cli import PRELOAD
    from nxdtrain.parallel.dist import spawn

    if args.tree and not Path(nxdtrain.__file__).resolve().is_relative_to(Path(args.tree).resolve()):
        raise SystemExit(f"--tree {args.tree}: nxdtrain came from {nxdtrain.__file__}")
    src, out = Path(args.src), Path(args.one_out)
    work = out.parent / f"{out.stem}-ranks"
    work.mkdir()
    options = nxd_options(args, src, args.gbs // args.nproc)
    if args.one == "nxdtrain":
        code = spawn(nxd_worker, ({**options, "ep": args.nproc}, args.steps, args.warmup, work), args.nproc,
                     timeout_s=args.timeout, preload=PRELOAD)
    else:
        code = spawn(hf_worker, (str(src), options, args.steps, args.warmup, False, work), args.nproc,
                     timeout_s=args.timeout, preload=(*PRELOAD, "transformers"))
    if code == 0:
        result = collect(work, args.nproc, args.one, "none", args.gbs * args.seq, 0.0, None)
        ranks = [json.loads((work / f"rank{r}.json").read_text())["cpu"] for r in range(args.nproc)]
        cpu = [sum(step) for step in zip(*ranks, strict=True)]  # the world's CPU seconds per step
        out.write_text(json.dumps({"step_s": result.step_s, "cpu_s": cpu, "tokens_per_step": args.gbs * args.seq}))
    return code


def _row(kind: str, nproc: int, tree: str, args: argparse.Namespace, forms: tuple[Path, Path, Path],
         out: Path) -> tuple[float, float] | str:
    """(tokens per second, tokens per CPU-second of the world) of one row in fresh processes, or why there is none."""
    hf, nxd, dcp = forms
    shape = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--seq", str(args.seq), "--gbs",
             str(args.gbs), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if kind == "torchtitan":
        if not Path(args.titan_python).exists():
            return "skipped: no TorchTitan venv"
        command = [args.titan_python, str(REPO / "tests" / "titan_train_bench.py"), str(dcp), str(out),
                   "--batch", str(args.gbs), "--seq", str(args.seq), "--vocab", str(VOCAB), "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--nproc", str(nproc)]
    else:
        src = nxd if kind == "nxdtrain" else hf
        command = [sys.executable, __file__, "--one", kind, "--nproc", str(nproc), "--src", str(src), "--one-out",
                   str(out), "--tree", tree, *shape]
    env = {**os.environ, "PYTHONPATH": str(REPO), **({THREADS_ENV: str(args.threads)} if args.threads else {})}
    if args.malloc == "glibc":  # the allocator as users run it (see --malloc)
        env.pop(MMAP_ENV, None)
        env[GLIBC_MALLOC_ENV] = "1"
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=args.timeout)
    if done.returncode != 0 or not out.exists():
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return f"failed: {tail[0][:120]}"
    data = json.loads(out.read_text())
    return data["tokens_per_step"] / statistics.median(data["step_s"]), data["tokens_per_step"] / statistics.median(
        data["cpu_s"])


def trainers_table(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]], list[str]]:
    """nxdtrain (this tree, and --before's) against TorchTitan's trainer and a transformers loop, alternated."""
    here = str(REPO)
    trees = [("nxdtrain", here)] + ([("nxdtrain before", args.before)] if args.before else [])
    kinds = [*trees, ("torchtitan", ""), ("transformers", "")]
    results: dict[tuple[str, int], list[tuple[float, float] | str]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-train-vs-") as tmp:
        root = Path(tmp)
        forms = build_qwen3(root, args)
        for repeat in range(args.repeats):
            order = kinds if repeat % 2 == 0 else kinds[::-1]
            for nproc in (int(n) for n in args.worlds.split(",")):
                for label, tree in order:
                    kind = label.split()[0]
                    out = root / f"{label.replace(' ', '-')}-{nproc}-{repeat}.json"
                    value = _row(kind, nproc, tree, args, forms, out)
                    results.setdefault((label, nproc), []).append(value)
                    shown = value if isinstance(value, str) else f"{value[0]:8.0f} tok/s {value[1]:8.0f} tok/CPU-s"
                    print(f"repeat {repeat}, {nproc} process(es), {label}: {shown} (load {os.getloadavg()[0]:.1f})",
                          flush=True)
    rows = []
    for (label, nproc), values in results.items():
        numbers = [v for v in values if not isinstance(v, str)]
        rows.append({"row": label, "procs": nproc, "measured": values,
                     "tokens_per_s": statistics.median(v[0] for v in numbers) if numbers else None,
                     "tokens_per_cpu_s": statistics.median(v[1] for v in numbers) if numbers else None,
                     "note": next((v for v in values if isinstance(v, str)), "")})
    lines = ["| world | trainer | tokens/s | each repeat | nxdtrain / this | tokens per CPU-s | nxdtrain / this |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        ours = next(r for r in rows if r["row"] == "nxdtrain" and r["procs"] == row["procs"])
        cells = []
        for key in ("tokens_per_s", "tokens_per_cpu_s"):
            mine = row[key]
            cells += [f"{mine:.0f}" if mine else row["note"],
                      f"{ours[key] / mine:.2f}x" if ours[key] and mine else ""]
        each = ", ".join("-" if isinstance(v, str) else f"{v[0]:.0f}" for v in row["measured"])
        world = "1 process" if row["procs"] == 1 else "2 processes"
        lines.append(f"| {world} | {row['row']} | {cells[0]} | {each} | {cells[1]} | {cells[2]} | {cells[3]} |")
    text = (f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, 8 experts top-2, seq {args.seq}, global batch "
            f"{args.gbs} rows (one micro-batch per rank), fp32, AdamW; torch threads per process: "
            f"{args.threads or 'CPUs / processes'}; allocator: {args.malloc}; medians over {args.repeats} alternated "
            f"repeats; load at the end: {os.getloadavg()[0]:.2f}\n\n" + "\n".join(lines) + "\n")
    failed = [f"{r['row']} ({r['procs']})" for r in rows if r["note"].startswith("failed")]
    return text, rows, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, hidden 128, seq 64, one step: a smoke check")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--table", choices=("ep", "trainers", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=3, help="of the trainers table, alternated")
    parser.add_argument("--before", help="another tree (main at a branch point): its nxdtrain in the trainers table")
    parser.add_argument("--titan-python", default=str(REPO / ".venv-titan" / "bin" / "python"),
                        help="the TorchTitan venv's python (make setup-titan)")
    parser.add_argument("--worlds", default="1,2", help="the trainers table's process counts (1, 2 or both)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per process for every trainer (default: the CPUs / processes)")
    parser.add_argument("--malloc", choices=("glibc", "return"), default="glibc",
                        help="the trainers table's allocator: glibc's default (as users run; the default), or "
                             "benchmarks/train.py's MALLOC_MMAP_THRESHOLD_=64 KiB (freed blocks go back to the kernel "
                             "and every reallocation is page-faulted again: the tables before issue #47's third pass)")
    parser.add_argument("--one", choices=("nxdtrain", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--nproc", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--one-out", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq, args.steps, args.repeats = 2, 128, 64, 1, 1
    if args.one:
        return one_row(args)
    texts, data, failed = [], {}, []
    for name, table in (("ep", ep_table), ("trainers", trainers_table)):
        if args.table in (name, "all"):
            text, rows, bad = table(args)
            texts.append(text)
            data[name] = rows
            failed += bad
    text = "\n".join(texts)
    print("\n" + text)
    OUT.mkdir(exist_ok=True)
    (OUT / "train-moe.md").write_text(text)
    (OUT / "train-moe.json").write_text(json.dumps({"args": vars(args), **data}, indent=1))
    if failed:
        print(f"failed rows: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
