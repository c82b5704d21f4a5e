"""Peak memory of ``ckptconv reshard`` (or ``to-dcp``) of a training tag (with its optimizer state) against the
weights alone.

Builds a training tag in real layer shapes (synthetic bf16 weights converted to NxD shards, nxdtrain's format-2
optimizer files with fp32 ``exp_avg``, ``exp_avg_sq`` and masters, side files, markers, ckptconv.json records),
then reshards it with its optimizer state and with ``--weights-only``, each under ``/usr/bin/time``, whose peak
RSS is reported.

    python benchmarks/reshard_optim.py WORKDIR --shape 8b --layers 1 --vocab 16384
    python benchmarks/reshard_optim.py WORKDIR --shape 8b --layers 1 --vocab 16384 --to-dcp   # TorchTitan's DCP
    python benchmarks/reshard_optim.py WORKDIR --shape 8b --layers 1 --vocab 16384 --nxd-format  # NxD's own format
    python benchmarks/reshard_optim.py WORKDIR --shape 8b --layers 1 --vocab 16384 --to-dcp --nxd-tag  # NxD's tag

``--to-dcp --nxd-tag``: the tag is first rewritten in NxD's own format (ZeRO-1, ``CosineAnnealing``; not timed),
then to-dcp of that NxD tag is timed against ``cp -r`` of the same tag (bytes in and out reported).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.measure import du
from benchmarks.synth import write_model
from ckptconv.commands.api import RunOptions, to_nxd
from ckptconv.io.digest import record_files
from ckptconv.io.metadata import read_metadata, write_metadata
from ckptconv.io.nxd_read import load_shard
from ckptconv.io.tags import write_markers
from ckptconv.training.nxdtrain_format.state import (
    FORMAT,
    MASTER,
    SCHEDULER_FILE,
    USER_CONTENT_FILE,
    stage_groups,
    state_key,
)

# torch AdamW's param-group fields, as nxdtrain's optimizer files record them
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "maximize": False, "foreach": None,
         "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}


def make_training_tag(tag: Path, schedule: str = "cosine", tp: int = 8) -> int:
    """Turn converted shards into an nxdtrain-like tag; return the optimizer bytes written. fp32 weights get no
    separate masters (nxdtrain keeps masters only for a bf16 run)."""
    (tag / "optim").mkdir()
    total = 0
    for shard in sorted((tag / "model").iterdir()):
        weights = load_shard(shard)
        names = [k for k in weights if not k.endswith("inv_freq")]
        groups = stage_groups(names, {n: tuple(weights[n].shape) for n in names})
        owned = [n for g in groups for n, _ in g]
        flat: dict[str, object] = {"format": FORMAT, "names": names, "zero1": False, "zero_size": 1, "dp_rank": 0,
                                   "owned": owned,
                                   "param_groups": [{**ADAMW, "weight_decay": 0.1}, {**ADAMW, "weight_decay": 0.0}]}
        for name in owned:
            w = weights[name].float()
            flat[state_key(name, "step")] = torch.tensor(100.0)
            flat[state_key(name, "exp_avg")] = w * 1e-3
            flat[state_key(name, "exp_avg_sq")] = w * w * 1e-6
            masters = weights[name].dtype != torch.float32
            if masters:
                flat[state_key(name, MASTER)] = w
            total += (2 + masters) * w.numel() * 4
        torch.save(flat, tag / "optim" / shard.name)
        del weights, flat
    torch.save({"step": 100, "schedule": schedule, "lr": 1e-4, "min_lr": 1e-5, "warmup": 10, "decay_steps": 1000},
               tag / SCHEDULER_FILE)
    torch.save({"step": 100, "consumed_samples": 400, "rng": [], "options": {"tp": tp, "pp": 1}}, tag / USER_CONTENT_FILE)
    meta = read_metadata(tag)
    assert meta is not None
    extra = [p for p in sorted((tag / "optim").iterdir())] + [tag / SCHEDULER_FILE, tag / USER_CONTENT_FILE]
    meta.files.update({rel: rec.to_json() for rel, rec in record_files(extra, tag, "blake3").items()})
    write_metadata(tag, meta)
    write_markers(tag)
    return total


def nxd_tag(tag: Path, work: Path) -> None:
    """to-dcp of the tag rewritten in NxD's own format (ZeRO-1), against ``cp -r`` of that tag."""
    nxd = work / "nxd-tag"
    subprocess.run([sys.executable, "-m", "ckptconv.cli", "reshard", str(tag), str(nxd), "--tp", "8", "--pp", "1",
                    "--dp", "1", "--zero1", "--optimizer-format", "nxd", "--quiet"], check=True)
    shutil.rmtree(tag)
    wall, rss = peak([sys.executable, "-m", "ckptconv.cli", "to-dcp", str(nxd), str(work / "dcp"), "--quiet", "--io",
                      "read"])
    started = time.monotonic()
    subprocess.run(["cp", "-r", str(nxd), str(work / "copy")], check=True)
    cp = time.monotonic() - started
    print(f"to-dcp of NxD's tag (tp 8, ZeRO-1 bf16 with fp32 masters): {du(nxd) / 1e9:.2f} GB in, "
          f"{du(work / 'dcp') / 1e9:.2f} GB out; {wall:.1f} s, cp -r {cp:.1f} s ({wall / cp:.2f}x), "
          f"peak RSS {rss / 2**20:.0f} MiB")
    shutil.rmtree(work)


def peak(argv: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a command, measured by /usr/bin/time: a child forked from this
    process would inherit this process's RSS into its ru_maxrss (kept across exec), and this one held shards."""
    started = time.monotonic()
    done = subprocess.run(["/usr/bin/time", "-f", "%M", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{argv}: exit status {done.returncode}: {done.stderr[-2000:]}")
    return time.monotonic() - started, int(done.stderr.strip().splitlines()[-1]) * 1024


def build_tag(work: Path, shape: str, layers: int, vocab: int, tp: int = 8, dtype: str = "keep",
              schedule: str = "cosine") -> Path:
    """``work/tag``: a training tag of ``shape``'s layer shapes (weights in ``dtype``) at tp ``tp``."""
    write_model(work / "hf", shape, layers, vocab=vocab)
    tag = work / "tag"
    to_nxd(work / "hf", tag, tp=tp, attention="qkv_linear", fuse_qkv=True, dtype=dtype,
           options=RunOptions(quiet=True, part=(0, 1)))
    shutil.rmtree(work / "hf")
    make_training_tag(tag, schedule, tp)
    return tag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--shape", choices=("8b", "70b"), default="8b")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--to-dcp", action="store_true", help="measure to-dcp (TorchTitan) instead of reshard")
    parser.add_argument("--nxd-tag", action="store_true", help="with --to-dcp: of the tag in NxD's own format")
    parser.add_argument("--nxd-format", action="store_true",
                        help="reshard into NxD's own optimizer format (--optimizer-format nxd)")
    args = parser.parse_args()
    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    write_model(work / "hf", args.shape, args.layers, vocab=args.vocab)
    tag = work / "tag"
    to_nxd(work / "hf", tag, tp=8, attention="qkv_linear", fuse_qkv=True, options=RunOptions(quiet=True, part=(0, 1)))
    shutil.rmtree(work / "hf")
    optim_bytes = make_training_tag(tag, "CosineAnnealing" if args.nxd_format or args.nxd_tag else "cosine")
    if args.to_dcp and args.nxd_tag:
        nxd_tag(tag, work)
        return
    if args.to_dcp:
        cli, flags, state_flags = [sys.executable, "-m", "ckptconv.cli", "to-dcp", str(tag)], ["--quiet", "--io", "read"], []
        what = "tp 8 -> TorchTitan DCP"
    else:
        cli = [sys.executable, "-m", "ckptconv.cli", "reshard", str(tag)]
        flags, state_flags = ["--tp", "4", "--pp", "1", "--quiet", "--io", "read"], ["--dp", "2", "--zero1"]
        what = "tp 8 -> tp 4 x dp 2 ZeRO-1"
        if args.nxd_format:
            state_flags.extend(["--optimizer-format", "nxd"])
            what += " in NxD's format"
    with_state = peak([*cli, str(work / "out-state"), *flags, *state_flags])
    shutil.rmtree(work / "out-state")
    weights = peak([*cli, str(work / "out-weights"), *flags, "--weights-only"])
    print(f"{args.shape} x{args.layers} layers, vocab {args.vocab}, {what}: optimizer state "
          f"{optim_bytes / 1e9:.2f} GB; with it {with_state[0]:.1f} s, peak RSS {with_state[1] / 2**20:.0f} MiB; "
          f"weights only {weights[0]:.1f} s, peak RSS {weights[1] / 2**20:.0f} MiB")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
