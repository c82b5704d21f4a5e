"""``make bench-train``'s MoE table: nxdtrain on a Mixtral at ep 1 and ep 2 in the same world, in one run.

A random Mixtral scaled to a small machine (default: 4 layers, hidden 256, 8 heads, 2 K/V heads, 8 experts of
intermediate 512, top-2, vocab 4096, seq 256, fp32) is saved once and converted; each row trains ``--warmup`` and
then ``--steps`` timed steps of the same global batch in 2 forkserver processes (dp 2; at ep 2 each dp rank holds 4
experts and the tokens travel by all-to-all), AdamW, aux coefficient 0.02. Reported: tokens/s of the world (median
step), the largest per-rank peak RSS (VmHWM, as benchmarks/train.py measures it) and the bytes each rank sends to
other ep ranks per step by all-to-all, forward and backward (``nxdtrain.parallel.experts.Traffic``). Written to
``bench-out/train-moe.md`` and ``.json``.

    python benchmarks/train_moe.py [--quick] [--steps 3] [--seq 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: ckptconv, nxdtrain, benchmarks

from benchmarks.train import OUT, collect, nxd_worker  # noqa: E402  (also sets MALLOC_MMAP_THRESHOLD_ first)


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
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq, args.steps = 2, 128, 64, 1
    from nxdtrain.cli import PRELOAD
    from nxdtrain.parallel.dist import spawn

    rows, failed = [], []
    with tempfile.TemporaryDirectory(prefix="bench-train-moe-") as tmp:
        root = Path(tmp)
        src = build(root, args)
        base = dict(precision="fp32", data="synthetic", seq_len=args.seq, gbs=args.gbs, mbs=args.mbs,
                    steps=args.warmup + args.steps, lr=1e-4, warmup=0, schedule="constant", optimizer="adamw",
                    weight_decay=0.1, clip_grad=1.0, seed=1, dist_timeout=600.0, no_checkpoint=True, resume=str(src))
        for ep in (1, 2):
            out = root / f"out-ep{ep}"
            out.mkdir()
            code = spawn(moe_worker, ({**base, "ep": ep}, args.steps, args.warmup, out), 2, timeout_s=args.timeout,
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
    print("\n" + text)
    OUT.mkdir(exist_ok=True)
    (OUT / "train-moe.md").write_text(text)
    (OUT / "train-moe.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    if failed:
        print(f"failed rows: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
