"""End-to-end demo on bundled data: build a tiny Llama, convert it to NxD tp 2 x pp 2 and back.

Run with ``make demo`` (or ``python examples/demo.py OUT_DIR``). Nothing is downloaded: the model
is built by transformers from ``fixtures/tiny-llama/config.json`` with a fixed seed. The demo
fails (non-zero exit) if the round trip is not bit-exact or the logits differ.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

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


def main(out: Path) -> int:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
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
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "demo-out")))
