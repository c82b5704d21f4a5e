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

A second table times the kernel as the engine calls it for Mixtral (``CHUNKS``: chunks of stored rows, each
transposed into its columns of a wider target, a matrix's worth one after the other); ``--before PATH`` (a
``_transpose*.so`` built from another tree) adds that kernel's column, run alternately with this one's.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ckptconv.engine.slabs import GATHER_CHUNK
from ckptconv.io import transpose as _transpose
from ckptconv.io.transpose import native_kernel, native_transpose

# (name, stored rows, stored columns): the matrices the MoE rows of benchmarks/moe_cost.py transpose
SHAPES = [("mixtral gate_up slab, tp 4", 7168, 4096), ("mixtral down_proj, whole expert", 14336, 4096),
          ("qwen3_moe gate_up slab, tp 2", 768, 2048), ("qwen3_moe down_proj, whole expert", 768, 2048)]
# (rows, columns, source row stride, target row stride) of the chunks Mixtral's to-hf and to-nxd transpose (the model
# of benchmarks/moe_cost.py, seen by counting the engine's calls into the kernel)
CHUNKS = [(292, 3584, 7168, 4096), (256, 4096, 4096, 14336), (146, 3584, 14336, 4096), (256, 4096, 4096, 7168)]


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


def _load_kernel(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("_transpose", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _chunks(kernel: Any, source: torch.Tensor, target: torch.Tensor, chunk: tuple[int, int, int, int],
            count: int) -> None:
    """``count`` chunks of ``source``'s rows, one after the other, each into its columns of ``target``."""
    rows, cols, ss, ds = chunk
    for k in range(count):
        kernel.transpose(source.data_ptr() + k * rows * ss * 2, target.data_ptr() + k * rows * 2, rows, cols, ss, ds, 2)


def chunk_rows(repeat: int, before: Path | None) -> str:
    """CPU s/GB of the kernel over :data:`CHUNKS`, this tree's (and ``before``'s), alternated; each checked against
    torch's transpose."""
    torch.set_num_threads(1)
    kernels = {"this tree": _transpose._native}
    if before is not None:
        kernels = {"before": _load_kernel(before), **kernels}
    lines = [f"| chunk (rows x columns, source / target row stride) | {' | '.join(kernels)} |",
             f"| --- |{' ---: |' * len(kernels)}"]
    for rows, cols, ss, ds in CHUNKS:
        source = torch.randn(4096, ss).to(torch.bfloat16)
        target = torch.zeros(cols, ds, dtype=torch.bfloat16)
        count = min(source.size(0) // rows, ds // rows)
        gb = count * rows * cols * 2 / 1e9

        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(repeat):
            for name, kernel in kernels.items():
                start = time.thread_time()
                _chunks(kernel, source, target, (rows, cols, ss, ds), count)
                times[name].append((time.thread_time() - start) / gb)
                assert torch.equal(target[:, :count * rows], source[:count * rows, :cols].t()), name
                target.zero_()
        lines.append(f"| {rows} x {cols}, {ss} / {ds} | "
                     + " | ".join(f"{statistics.median(t):.3f}" for t in times.values()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--before", type=Path, help="another tree's built kernel (_transpose*.so) for the chunk table")
    args = parser.parse_args()
    print(floor_rows(args.repeat))
    if native_kernel():
        print(chunk_rows(args.repeat, args.before))


if __name__ == "__main__":
    main()
