"""Measurements behind nxdtrain.checkpoint.loss_check's margins: the first-batch loss of a tiny Llama loaded right and wrong.

A random tiny model sits at ln(vocab) however its shards are read, so the source is first trained (HF, AdamW)
on arithmetic rows whose stride only attention can read, until its loss is far below ln(vocab). It is then
converted at tp 4 x kvm 2 (8 query heads, 2 K/V heads), read right or with the K/V heads of tp ranks 0 <-> 1 and
2 <-> 3 swapped (replicas still consistent, so no structural check sees it), and nxdtrain logs the loss of step 1
(its forward runs before the update: the loss the check sees):

    python -m tests.nxdtrain.measure_loss_check OUT [--steps 400]

Prints one JSON object: ln(vocab), the HF loss after training, and nxdtrain's first loss per case.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from tests.conftest import make_tiny_llama
from tests.nxdtrain.harness import convert
from tests.nxdtrain.wrong_loads import VOCAB, pair_kv_wrongly, pattern_rows, trained_llama, write_rows

LAYOUT = dict(tp=4, attention="qkv_linear", kv_size_multiplier=2)
SHAPE = dict(heads=8, kv_heads=2, layers=3)


def wrong(converted: Path) -> Path:
    pair_kv_wrongly(converted)
    return converted


def first_loss(src: Path, data: Path, log: Path) -> float:
    argv = [sys.executable, "-m", "nxdtrain.cli", "run", "--resume", str(src), "--nproc", "4", "--tp", "4",
            "--data", str(data), "--seq-len", "16", "--gbs", "8", "--steps", "1", "--allow-high-loss",
            "--no-checkpoint", "--precision", "fp32", "--log-jsonl", str(log)]
    subprocess.run(argv, check=True, capture_output=True)
    return float(json.loads(log.read_text().splitlines()[0])["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=400, help="HF training steps of the tiny source")
    args = parser.parse_args()
    root = args.out
    root.mkdir(parents=True, exist_ok=False)
    hf, hf_loss = trained_llama(root / "hf", steps=args.steps, **SHAPE)
    rand = make_tiny_llama(root / "rand", vocab=VOCAB, **SHAPE)
    data = write_rows(root / "rows.jsonl", pattern_rows(64, 16, seed=5))
    cases = {
        "random init, read right": convert(rand, root / "rand-right", **LAYOUT),
        "random init, K/V heads on the wrong ranks": wrong(convert(rand, root / "rand-wrong", **LAYOUT)),
        "trained, read right": convert(hf, root / "right", **LAYOUT),
        "trained, K/V heads on the wrong ranks": wrong(convert(hf, root / "wrong", **LAYOUT)),
    }
    losses = {name: round(first_loss(src, data, root / f"{k}.jsonl"), 4) for k, (name, src) in enumerate(cases.items())}
    print(json.dumps({"ln_vocab": round(math.log(VOCAB), 4), "hf_steps": args.steps, "hf_loss": round(hf_loss, 4),
                      "first_loss": losses}, indent=1))


if __name__ == "__main__":
    main()
