"""The floor under an MoE conversion's CPU (issue 47): what transposing an expert matrix costs against copying the
same bytes, on this machine (``python benchmarks/transpose_floor.py [--repeat N]``).

NxD stores every expert matrix transposed against HF, so to-nxd and to-hf move each expert byte through one
transpose that a dense conversion does not do; a dense conversion reads each byte into its output and writes it.
Per shape (bf16, one torch thread, thread CPU time, median of ``--repeat``), in CPU s/GB of the matrix:

* ``memcpy``: ``copy_`` of the contiguous matrix into a warm buffer (what a read costs the kernel, about);
* ``transpose``: torch's blocked transpose (``copy_`` of a transposed contiguous matrix into a contiguous one, the
  fast path the engine arranges for) into a warm buffer;
* ``in 2 MiB chunks``: what the engine does with a slab over 16 MiB (``ckptconv.engine.slabs._read_transposed``): each
  chunk of stored rows transposed into a cache-warm matrix, then copied into its columns of the target;
* ``fresh pages``: first touch of as many bytes of new memory (the page faults and zeroing a band's output costs on
  a worker's first band; the same for a dense conversion's output);
* ``native``: ckptconv's own kernel (``ckptconv.io.transpose``, SIMD tiles; what the engine uses where it is built)
  into the same warm buffer, and ``native / memcpy``.

The marginal CPU of an MoE conversion can not fall below a dense one's by less than ``transpose - memcpy`` per
expert byte (the transpose replaces nothing the dense path does: its read lands in a buffer, not in the output).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ckptconv.engine.slabs import GATHER_CHUNK
from ckptconv.io.transpose import native_kernel, native_transpose

# (name, stored rows, stored columns): the matrices the MoE rows of benchmarks/moe_cost.py transpose
SHAPES = [("mixtral gate_up slab, tp 4", 7168, 4096), ("mixtral down_proj, whole expert", 14336, 4096),
          ("qwen3_moe gate_up slab, tp 2", 768, 2048), ("qwen3_moe down_proj, whole expert", 768, 2048)]


def _cpu(work, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        start = time.thread_time()
        work()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def _row(name: str, rows: int, cols: int, repeat: int) -> str:
    source = torch.randn(rows, cols).to(torch.bfloat16)
    gb = source.numel() * source.element_size() / 1e9
    target = torch.empty(cols, rows, dtype=torch.bfloat16).copy_(source.t())  # both targets warm
    flat = torch.empty_like(source).copy_(source)
    copy = _cpu(lambda: flat.copy_(source), repeat) / gb
    flip = _cpu(lambda: target.copy_(source.t()), repeat) / gb
    fresh = _cpu(lambda: torch.empty(rows, cols, dtype=torch.bfloat16).fill_(0), repeat) / gb
    step = max(64, GATHER_CHUNK // (cols * source.element_size()))
    chunk = torch.empty(cols, step, dtype=torch.bfloat16)

    def chunked() -> None:
        for lo in range(0, rows, step):
            n = min(step, rows - lo)
            flip = chunk[:, :n] if n == step else torch.empty(cols, n, dtype=torch.bfloat16)
            flip.copy_(source[lo:lo + n].t())
            target[:, lo:lo + n].copy_(flip)

    chunks = _cpu(chunked, repeat) / gb
    native = _cpu(lambda: native_transpose(target, source), repeat) / gb if native_kernel() else float("nan")
    return (f"| {name} [{cols}, {rows}] | {gb:.3f} | {copy:.3f} | {flip:.3f} | {chunks:.3f} | {fresh:.3f} "
            f"| {min(flip, chunks) / copy:.1f}x | {native:.3f} | {native / copy:.1f}x |")


def floor_rows(repeat: int) -> str:
    torch.set_num_threads(1)
    lines = ["| matrix | GB | memcpy s/GB | transpose s/GB | in 2 MiB chunks s/GB | fresh pages s/GB | "
             "fastest torch transpose / memcpy | native s/GB | native / memcpy |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [_row(name, rows, cols, repeat) for name, rows, cols in SHAPES]
    return "\n".join(lines) + f"\nnative kernel: {native_kernel() or 'none (not built, or CKPTCONV_NATIVE=0)'}\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    print(floor_rows(parser.parse_args().repeat))


if __name__ == "__main__":
    main()
