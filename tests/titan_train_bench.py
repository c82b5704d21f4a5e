"""``make bench-train``'s TorchTitan row: TorchTitan 0.3.0's own trainer (``Trainer.train()`` of the
``continue_run()`` that to-dcp wrote), run as the TorchTitan lane runs it (the CPU shims of tests/titan_shims.py),
timed per ``train_step``. benchmarks/train_moe.py runs this file by path with the TorchTitan venv's python
(benchmarks import nothing from tests/); it is a harness, not a test.

    .venv-titan/bin/python tests/titan_train_bench.py DCP OUT.json --batch 8 --seq 256 --steps 3 --warmup 1 --nproc 2

With ``--nproc 2`` it starts itself once per rank (the environment torchrun sets), data parallel over both ranks
by DDP (``data_parallel_replicate_degree``): on CPU with torch 2.14.1, FSDP's reduce-scatter asks gloo for
``PREMUL_SUM``, which it lacks, and TorchTitan's expert parallel (``--ep 2``) sends its uneven all-to-all through
gloo's ``alltoall``, which takes equal sizes only; each rank trains ``batch / nproc`` rows. The launcher writes
``{"step_s": [...], "cpu_s": [...], "tokens_per_step": N}`` to OUT.json: the timed steps after the warmup, each the
slowest rank's wall seconds and the ranks' CPU seconds summed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.titan_shims


def _rank(args: argparse.Namespace) -> None:
    import pytest
    import torch
    import torch.distributed as dist

    from tests.titan_shims import cpu_device, generated_config, rows_dataloader, rows_tokenizer, sdpa_attention

    # what nxdtrain does per rank, unless benchmarks/train_moe.py --threads fixes it (BENCH_TRAIN_THREADS)
    torch.set_num_threads(int(os.environ.get("BENCH_TRAIN_THREADS") or 0) or max(1, len(os.sched_getaffinity(0)) // args.nproc))
    local = args.batch // args.nproc
    steps = args.warmup + args.steps
    rank = int(os.environ["RANK"])
    # the same global batches on every rank; each rank takes its rows (dp), as the trainer's loader would
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(step))
               [rank * local:(rank + 1) * local] for step in range(steps)]
    with pytest.MonkeyPatch.context() as mp:
        module = generated_config(args.dcp)
        for name, value in dict(LOCAL_BATCH_SIZE=local, SEQ_LEN=args.seq, STEPS=steps, MIXED_PRECISION_PARAM="float32",
                                DUMP_FOLDER=str(args.dump), DATA_PARALLEL_SHARD_DEGREE=1).items():
            mp.setattr(module, name, value)
        config = module.continue_run()
        # DDP: FSDP's reduce-scatter asks gloo for PREMUL_SUM, which it lacks (torch 2.14.1)
        config.parallelism.data_parallel_replicate_degree = args.nproc
        config.parallelism.expert_parallel_degree = args.ep
        sdpa_attention(config.model_spec.model)
        config.tokenizer = rows_tokenizer()
        config.dataloader = rows_dataloader(batches)
        config.training.disable_cuda_graphs = True
        config.metrics.log_freq = 1
        cpu_device(mp)
        trainer = config.build()
        seconds: list[float] = []
        cpu_s: list[float] = []  # this process's CPU seconds (all its threads) per step
        step = trainer.train_step

        def timed(*a: object, **kw: object) -> object:
            started, cpu = time.perf_counter(), time.process_time()
            out = step(*a, **kw)
            seconds.append(time.perf_counter() - started)
            cpu_s.append(time.process_time() - cpu)
            return out

        mp.setattr(trainer, "train_step", timed)
        mp.setattr(trainer.checkpointer, "save", lambda *a, **kw: None)  # nxdtrain's rows do not save either
        try:
            trainer.train()
        finally:
            trainer.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    mine = Path(f"{args.out}.rank{rank}")
    mine.write_text(json.dumps({"step_s": seconds[args.warmup:], "cpu_s": cpu_s[args.warmup:]}))


def _launch(args: argparse.Namespace) -> int:
    """One process per rank, with the environment torchrun gives its workers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.nproc), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(args.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TITAN_BENCH_RANK": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env))
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if max(abs(c) for c in codes):
        return max(abs(c) for c in codes)
    ranks = [json.loads(Path(f"{args.out}.rank{r}").read_text()) for r in range(args.nproc)]
    # a step ends when its slowest rank ends; the world's CPU is every rank's
    step_s = [max(times) for times in zip(*(r["step_s"] for r in ranks), strict=True)]
    cpu_s = [sum(times) for times in zip(*(r["cpu_s"] for r in ranks), strict=True)]
    args.out.write_text(json.dumps({"step_s": step_s, "cpu_s": cpu_s, "tokens_per_step": args.batch * args.seq}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dcp", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    args.dump = args.out.parent / f"{args.out.stem}-dump"
    if "TITAN_BENCH_RANK" in os.environ:
        _rank(args)
        return 0
    return _launch(args)


if __name__ == "__main__":
    sys.exit(main())
