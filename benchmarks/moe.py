"""The mixture-of-experts rows of ``make bench``: Mixtral-8x7B's layer shapes (hidden 4096, expert intermediate
14336, 8 experts top-2, 32 query / 8 KV heads) with a small vocabulary, to-nxd at tp 8 x ep 2 and a reshard of that
to tp 4 x ep 4, each paired with ``cp -r`` of the same input (benchmarks/run.py's harness): ratio to cp, CPU seconds
per GB written, peak RSS. One layer is 2.9 GB of bf16 (the experts 2.8 GB of it); the disk in use peaks at about
twice the model (input and output; the cp copy is deleted before each conversion).

    python benchmarks/run.py --moe [--layers N] [--repeat N]
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from synth import write_config

MIXTRAL_8X7B = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=4096,
                    intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32,
                    num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
                    tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=1024)


def moe_rows(out: Path, convert: Callable[..., Any], cpu_seconds: list[float], layers: int,
             repeat: int) -> tuple[list[Any], list[str]]:
    """to-nxd tp 8 x ep 2 and reshard to tp 4 x ep 4 of a Mixtral-8x7B-shaped model under ``out`` with run.py's
    ``convert`` (its ``CPU_SECONDS``: ``cpu_seconds``); the rows, and a line per row with its CPU s/GB written."""
    hf = out / f"hf-mixtral-{layers}l"
    shutil.rmtree(hf, ignore_errors=True)
    print(f"generating {hf.name} (Mixtral-8x7B layer shapes, {layers} layers, vocab 1024) ...", flush=True)
    write_config(hf, {**MIXTRAL_8X7B, "num_hidden_layers": layers})
    label = f"mixtral-8x7b x{layers} layers"
    nxd, resharded = out / "nxd-mixtral", out / "nxd-mixtral-ep4"
    rows, cpu = [], []
    rows.append(convert(f"to-nxd {label}: tp 8 ep 2", ["to-nxd", str(hf), str(nxd), "--tp", "8", "--ep", "2"], hf,
                        nxd, repeat))
    cpu.append(cpu_seconds[-1])
    shutil.rmtree(hf)  # the shards are the input from here on: less disk in use
    rows.append(convert(f"reshard {label}: tp 8 ep 2 -> tp 4 ep 4",
                        ["reshard", str(nxd), str(resharded), "--tp", "4", "--ep", "4"], nxd, resharded, repeat))
    cpu.append(cpu_seconds[-1])
    shutil.rmtree(resharded)
    shutil.rmtree(nxd)
    notes = [f"{row.case}: CPU {seconds:.1f} s (user + system, last run), {seconds / (row.bytes_written / 1e9):.2f} "
             f"CPU s/GB written" for row, seconds in zip(rows, cpu, strict=True)]
    return rows, notes
