"""End-to-end demo on bundled data: build a tiny Llama, convert it to NxD tp 2 x pp 2 and back,
then train it a few steps from those shards and export the result.

Run with ``make demo`` (or ``python examples/demo.py OUT_DIR``). Nothing is downloaded: the model
is built by transformers from ``fixtures/tiny-llama/config.json`` with a fixed seed, and the
training rows are ``fixtures/corpus/train.jsonl`` (byte-level tokens of a small bundled text).
The demo fails (non-zero exit) if the round trip is not bit-exact or the logits differ, or if
training does not lower the loss on rows it never saw. It draws the run's loss, learning rate and
throughput into ``OUT_DIR/curves.png`` (``nxdtrain plot``) and prints its path.

OUT_DIR is the demo's own: it declares what it writes there (as every ckptconv writer does,
``ckptconv.engine.outdir``), a rerun replaces only that, and an OUT_DIR holding anything else is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ckptconv.engine import outdir

REPO = Path(__file__).resolve().parents[1]
CKPTCONV = [sys.executable, "-m", "ckptconv.cli"]


def sh(*argv: str) -> None:
    print("\n$ ckptconv " + " ".join(argv[len(CKPTCONV):]), flush=True)
    subprocess.run(argv, check=True)


def build_model(out: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(**json.loads((REPO / "fixtures" / "tiny-llama" / "config.json").read_text()))
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(out, max_shard_size="200KB")
    print(f"built a tiny Llama ({sum(p.numel() for p in model.parameters()):,} parameters) in {out}")


def logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits


# Everything the demo writes in OUT_DIR, declared before the first of them is written.
WRITES = ["hf", "nxd", "hf-back", "train", "train-log.jsonl", "curves.png", "hf-trained"]


def claim(out: Path) -> str | None:
    """Make OUT_DIR the demo's: refuse (the reason, one line) when it holds anything the demo did not declare,
    else remove the demo's earlier output and declare what this run writes."""
    if out.exists() and not out.is_dir():
        return f"{out}: not a directory; choose another OUT_DIR"
    strangers = outdir.foreign(out)
    if strangers:
        return (f"{out}: holds {strangers[0]!r}, which the demo did not write; choose another OUT_DIR "
                "(the demo removes only its own earlier output)")
    outdir.remove_owned(out, keep=())
    out.mkdir(parents=True, exist_ok=True)
    outdir.declare(out, "demo", WRITES)
    return None


def main(out: Path) -> int:
    refused = claim(out)
    if refused is not None:
        print(f"demo: error: {refused}", file=sys.stderr)
        return 1
    build_model(out / "hf")
    sh(*CKPTCONV, "to-nxd", str(out / "hf"), str(out / "nxd"), "--tp", "2", "--pp", "2",
       "--qkv-linear", "--fuse-qkv", "--kv-size-multiplier", "1")
    sh(*CKPTCONV, "inspect", str(out / "hf"))
    sh(*CKPTCONV, "inspect", str(out / "nxd"))
    sh(*CKPTCONV, "to-hf", str(out / "nxd"), str(out / "hf-back"))
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    before, after = logits(out / "hf", ids), logits(out / "hf-back", ids)
    diff = (before - after).abs().max().item()
    print(f"\nlogits of the original and the round-tripped model: max |difference| = {diff}")
    if not torch.equal(before, after):
        print("FAILED: the round trip changed the model", file=sys.stderr)
        return 1
    print("round trip HF -> NxD (tp 2 x pp 2, fused QKV) -> HF is bit-exact")
    return train(out)


# --------------------------------------------------------------------------------------------
# Continual pretraining from the shards: nxdtrain run -> NxD checkpoint -> HF


NXDTRAIN = [sys.executable, "-m", "nxdtrain.cli"]
CORPUS = REPO / "fixtures" / "corpus" / "train.jsonl"
STEPS, GBS = 5, 8
SEEN_ROWS = STEPS * GBS  # --no-shuffle trains on the first rows; the rest are held out


def nxdtrain(*args: str) -> None:
    print("\n$ nxdtrain " + " ".join(args), flush=True)
    subprocess.run([*NXDTRAIN, *args], check=True)


def held_out_loss(path: Path) -> float:
    rows = [json.loads(line)["input_ids"] for line in CORPUS.read_text().splitlines()][SEEN_ROWS:]
    ids = torch.tensor(rows)
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path).eval()(ids, labels=ids).loss.item()


def train(out: Path) -> int:
    """Train the converted model (4 processes: tp 2 x pp 2) on the corpus, export it, and compare."""
    nxdtrain("run", "--nproc", "4", "--resume", str(out / "nxd"), "--tp", "2", "--pp", "2",
             "--data", str(CORPUS), "--no-shuffle", "--seq-len", "64", "--gbs", str(GBS), "--mbs", "2",
             "--steps", str(STEPS), "--lr", "3e-3", "--warmup", "1", "--precision", "fp32",
             "--checkpoint-dir", str(out / "train"), "--log-jsonl", str(out / "train-log.jsonl"),
             "--export-hf", str(out / "hf-trained"))
    sh(*CKPTCONV, "inspect", str(out / "train"))
    nxdtrain("plot", str(out / "train-log.jsonl"), "-o", str(out / "curves.png"),
             "--title", f"nxdtrain demo: tp 2 x pp 2, {STEPS} steps of {GBS} rows")
    print(f"loss, learning rate and throughput per step: {out / 'curves.png'}")
    before, after = held_out_loss(out / "hf"), held_out_loss(out / "hf-trained")
    print(f"\nloss on the {len(CORPUS.read_text().splitlines()) - SEEN_ROWS} held-out corpus rows: "
          f"{before:.4f} before training, {after:.4f} after {STEPS} steps")
    if not after < before:
        print("FAILED: training did not lower the held-out loss", file=sys.stderr)
        return 1
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    change = (logits(out / "hf", ids) - logits(out / "hf-trained", ids)).abs().max().item()
    print(f"logits of the trained model moved by up to {change:.3f}; HF -> NxD -> train -> HF done")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "demo-out")))
