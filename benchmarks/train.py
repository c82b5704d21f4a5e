"""``make bench-train``: nxdtrain's training speed and memory against a plain transformers loop, in one run.

A random Llama of real proportions scaled to a small machine (default: 8 layers, hidden 512, 8 heads,
2 K/V heads, intermediate 1408, vocab 8192, seq 512, fp32) is saved once and converted to the NxD
layouts the rows need. Each row trains ``--warmup`` steps and then ``--steps`` timed steps of the
same global batch in fresh processes (forkserver children, like ``nxdtrain run --nproc``), with
AdamW; rows:

* ``transformers``: ``LlamaForCausalLM`` with the same rows, microbatches and AdamW (checkpointing
  none, and full via ``gradient_checkpointing_enable``: it has no selective mode);
* nxdtrain tp 1, tp 2, tp 2 + sequence parallel, pp 2, dp 2 + ZeRO-1, each with activation
  checkpointing none / selective / full;
* ZeRO-1 against ``--shard-params`` (FSDP2) at dp 2 and 4 (``dp2-zero1``, ``dp2-shard``, ``dp4-zero1``,
  ``dp4-shard``; the same global batch, mbs 2 at dp 4).

``states`` is the largest per-rank count of the bytes of parameters (and fp32 masters), gradients and optimizer
state, on the local tensors after the first step (``nxdtrain.parallel.fsdp_run.state_bytes``): what sharding divides.

A second table, "long context", trains a smaller model (:data:`LONG`) on one row of ``--long-seq``
tokens (default 4096, the longest this machine trains in reasonable time) at tp 1, context parallel
2 and 4, and tp 2 + sequence parallel, without checkpointing: per-rank activation memory and
tokens/s against tp 1 (``--long-only`` runs just this table; ``--long-seq 0`` skips it).

Every process measures itself (``/proc/self/status``): ``peak`` is its VmHWM over the whole run;
``act`` is the activation peak: VmHWM of the timed steps minus the resident size when they start
(after the warmup, when weights, gradients and optimizer state exist; VmHWM is reset there through
``/proc/self/clear_refs``). glibc is told to return large freed blocks to the kernel
(``MALLOC_MMAP_THRESHOLD_``), for every row alike, so freed activations do not stay resident.
The table shows tokens/s of the whole world (median step) and the largest per-rank peak, with
ratios to the ``transformers`` row of the same run. Written to ``bench-out/train.md`` and ``.json``.

    python benchmarks/train.py [--quick] [--mbs 4] [--rows tp1,tp2-sp,...] [--modes none,full]

With a CUDA device the same script runs NCCL and bf16 (``--precision bf16``), measures the GPU's memory
(``torch.cuda.max_memory_allocated``, reset after the warmup) instead of the process's, and reports MFU against
``--peak-tflops``; ``--hidden`` widens the model to something a GPU notices (run on an H200: docs/parallelism.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Before torch (and the forkserver) start: large blocks go back to the kernel when freed, so RSS follows use. Not
# under GLIBC_MALLOC_ENV (train_moe.py's trainers table, which measures speed only): there every reallocation of a
# freed block would be page-faulted again, a cost of this setting that users' runs do not pay.
GLIBC_MALLOC_ENV = "BENCH_TRAIN_GLIBC_MALLOC"
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
if not os.environ.get(GLIBC_MALLOC_ENV):
    os.environ.setdefault(MMAP_ENV, str(1 << 16))

OUT = Path("bench-out")


@dataclass(frozen=True)
class Shape:
    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1408
    vocab: int = 8192
    seq: int = 512


QUICK = Shape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=352, vocab=1024, seq=128)
LONG = Shape(layers=2, hidden=256, heads=8, kv_heads=2, intermediate=704, vocab=8192, seq=4096)

# name: (tp, pp, dp, extra nxdtrain options)
ROWS: dict[str, tuple[int, int, int, dict[str, Any]]] = {
    "tp1": (1, 1, 1, {}),
    "tp2": (2, 1, 1, {}),
    "tp2-sp": (2, 1, 1, {"sequence_parallel": True}),
    "pp2": (1, 2, 1, {}),
    "dp2-zero1": (1, 1, 2, {"zero1": True}),
    # ZeRO-1 against FSDP2 (--shard-params) at the same global batch (mbs 2 at dp 4: one microbatch per rank)
    "dp2-shard": (1, 1, 2, {"shard_params": True}),
    "dp4-zero1": (1, 1, 4, {"zero1": True, "mbs": 2}),
    "dp4-shard": (1, 1, 4, {"shard_params": True, "mbs": 2}),
    "cp2": (1, 1, 1, {"context_parallel": 2}),
    "cp4": (1, 1, 1, {"context_parallel": 4}),
}
DEFAULT_ROWS = ("tp1", "tp2", "tp2-sp", "pp2", "dp2-zero1", "dp2-shard", "dp4-zero1", "dp4-shard")
LONG_ROWS = ("tp1", "cp2", "cp4", "tp2-sp")
MODES = ("none", "selective", "full")


@dataclass
class Result:
    row: str
    mode: str
    procs: int
    tokens_per_s: float
    step_s: list[float]
    peak_mib: float      # largest VmHWM over the ranks
    act_mib: float       # largest activation peak over the ranks (see the module docstring)
    mfu: float | None = None
    states_mib: float = 0.0  # largest model-state bytes over the ranks (see the module docstring)


# ------------------------------------------------------------------ measured inside each process


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


class HostMemory:
    """The process's resident memory (/proc/self/status), in KiB."""

    def peak(self) -> int:
        return _status_kib("VmHWM")

    def current(self) -> int:
        return _status_kib("VmRSS")

    def reset_peak(self) -> None:
        _reset_peak()


class CudaMemory:
    """The GPU's memory held by torch's allocator for this process, in KiB: on a GPU the activations live there."""

    def peak(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated() // 1024

    def current(self) -> int:
        import torch

        return torch.cuda.memory_allocated() // 1024

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()


def memory_of(device: Any) -> HostMemory | CudaMemory:
    return CudaMemory() if device.type == "cuda" else HostMemory()


class Probe:
    """Step times and memory of this process (the GPU's on cuda); written to ``out/rank<N>.json`` at the end."""

    def __init__(self, warmup: int, memory: HostMemory | CudaMemory) -> None:
        self.warmup, self.memory, self.times, self.hwm_warmup, self.rss_start = warmup, memory, [], 0, 0
        self.profiler: Any = None
        self.cpu: list[float] = []  # this process's CPU seconds (all its threads) per timed step
        self.cpu_mark = time.process_time()

    def step(self, index: int, seconds: float) -> None:
        now = time.process_time()
        if index >= self.warmup:
            self.cpu.append(now - self.cpu_mark)
        self.cpu_mark = now
        if index < self.warmup:
            if index == self.warmup - 1:
                self.hwm_warmup, self.rss_start = self.memory.peak(), self.memory.current()
                self.memory.reset_peak()
                self.profiler = _start_profiler()
            return
        self.times.append(seconds)

    def write(self, out: Path, rank: int, states: dict[str, int] | None = None) -> None:
        hwm = self.memory.peak()
        data = {"times": self.times, "peak_kib": max(hwm, self.hwm_warmup), "act_kib": hwm - self.rss_start,
                "states": sum((states or {}).values()), "cpu": self.cpu}
        (out / f"rank{rank}.json").write_text(json.dumps(data))
        if self.profiler is not None:
            self.profiler.stop()
            on_gpu = isinstance(self.memory, CudaMemory)
            table = self.profiler.key_averages().table(
                sort_by="self_cuda_time_total" if on_gpu else "self_cpu_time_total", row_limit=25, max_name_column_width=60)
            (out / f"profile-rank{rank}.txt").write_text(table)


PROFILE_ENV = "BENCH_TRAIN_PROFILE"  # set by --profile; the forkserver's children inherit it
THREADS_ENV = "BENCH_TRAIN_THREADS"  # torch threads per process, when set (train_moe.py --threads)


def _start_profiler() -> Any:
    """torch.profiler over the timed steps (--profile), else None; its overhead is in those steps' times."""
    if not os.environ.get(PROFILE_ENV):
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def _threads(nproc: int) -> None:
    import torch

    from ckptconv.engine.options import usable_cpus

    # what nxdtrain.train does, unless the benchmark fixes the threads per process (train_moe.py --threads)
    torch.set_num_threads(int(os.environ.get(THREADS_ENV) or 0) or max(1, usable_cpus() // nproc))


def nxd_worker(options: dict[str, Any], steps: int, warmup: int, out: Path) -> None:
    """One rank: nxdtrain's Trainer, the way ``nxdtrain.train.train`` drives it, with a probe around each step."""
    import torch.distributed as dist

    from nxdtrain.config.options import TrainConfig
    from nxdtrain.parallel.dist import detect_env, init_world, local_world_size
    from nxdtrain.train import Trainer, prepare

    config = TrainConfig.from_flat(options)
    env = detect_env()
    plan = prepare(config, env.world_size)
    _threads(local_world_size())
    device = init_world(env, config.dist_timeout, plan.device)
    probe = Probe(warmup, memory_of(device.torch_device))
    try:
        trainer = Trainer(plan, device)
        for index in range(warmup + steps):
            started = time.perf_counter()
            trainer.train_step(index + 1)
            _sync(device.torch_device)
            probe.step(index, time.perf_counter() - started)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    probe.write(out, env.rank, trainer.state_bytes)


def hf_worker(hf_dir: str, options: dict[str, Any], steps: int, warmup: int, checkpointing: bool, out: Path) -> None:
    """The reference: the checkpoint's transformers class (LlamaForCausalLM; an MoE's with its router aux loss,
    ``output_router_logits``), the same global batches in the same microbatches, AdamW, clipping. In a world of
    several processes (train_moe.py's 2-process row) it runs as a user would on CPU: DDP over gloo, each rank the
    contiguous ``gbs / world`` rows nxdtrain's dp ranks take, gradients all-reduced on the last microbatch."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from nxdtrain.config.options import TrainConfig
    from nxdtrain.data.rows import global_batches
    from nxdtrain.optim import make_torch_optimizer, param_groups
    from nxdtrain.parallel.dist import detect_env

    env = detect_env()
    _threads(env.world_size)
    cfg = TrainConfig.from_flat({**options, "resume": hf_dir})
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device)
    router = {"output_router_logits": True} if hasattr(model.config, "output_router_logits") else {}
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = make_torch_optimizer(param_groups(list(model.named_parameters()), cfg.optim.weight_decay),
                                     cfg.optim, lr=cfg.optim.lr)
    batches = global_batches(cfg, model.config.vocab_size)
    runner = _ddp(model, env) if env.world_size > 1 else model
    micro = cfg.data.gbs // env.world_size // cfg.data.mbs
    probe = Probe(warmup, memory_of(device))
    for index, ids in enumerate(batches[:warmup + steps]):
        started = time.perf_counter()
        chunks = ids.tensor_split(env.world_size)[env.rank].to(device).tensor_split(micro)
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1  # DDP all-reduces on the last microbatch only, as its no_sync is meant
            with contextlib.nullcontext() if last or runner is model else runner.no_sync():
                (runner(input_ids=chunk, labels=chunk, **router).loss / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
        optimizer.step()
        optimizer.zero_grad()
        _sync(device)
        probe.step(index, time.perf_counter() - started)
    if runner is not model:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    probe.write(out, env.rank)


def _ddp(model: Any, env: Any) -> Any:
    """``model`` in torch's DistributedDataParallel over gloo: the stock CPU data parallelism."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    return DistributedDataParallel(model)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ the launcher


def build_model(root: Path, shape: Shape, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = root / "hf"
    root.mkdir(parents=True, exist_ok=True)
    if (hf / "config.json").exists():
        return hf
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=shape.hidden, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         num_hidden_layers=shape.layers, vocab_size=shape.vocab, intermediate_size=shape.intermediate,
                         max_position_embeddings=max(2048, shape.seq), tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(hf)
    return hf


def converted(hf: Path, root: Path, tp: int, pp: int) -> Path:
    from ckptconv.commands.api import RunOptions, to_nxd

    out = root / f"nxd-tp{tp}-pp{pp}"
    if not (out / "ckptconv.json").exists():
        to_nxd(hf, out, options=RunOptions(quiet=True, part=(0, 1)), tp=tp, pp=pp, attention="qkv_linear",
               fuse_qkv=True)
    return out


def collect(out: Path, nprocs: int, row: str, mode: str, tokens_per_step: int, flops_per_token: float,
            peak_tflops: float | None) -> Result:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nprocs)]
    # A step ends when its slowest rank ends: the world's step time is the max over ranks.
    steps = [max(times) for times in zip(*(r["times"] for r in ranks), strict=True)]
    tps = tokens_per_step / statistics.median(steps)
    mfu = tps * flops_per_token / (peak_tflops * 1e12 * nprocs) if peak_tflops else None
    return Result(row, mode, nprocs, tps, steps, max(r["peak_kib"] for r in ranks) / 1024,
                  max(r["act_kib"] for r in ranks) / 1024, mfu, max(r.get("states", 0) for r in ranks) / 2**20)


def flops_per_token(shape: Shape) -> float:
    """6·N (matmul parameters, forward and backward) plus attention scores, causal half: the usual MFU count."""
    kv = shape.hidden // shape.heads * shape.kv_heads
    per_layer = shape.hidden * (2 * shape.hidden + 2 * kv) + 3 * shape.hidden * shape.intermediate
    matmul = shape.layers * per_layer + shape.hidden * shape.vocab
    return 6 * matmul + 6 * shape.layers * shape.seq * shape.hidden


def shape_of(args: argparse.Namespace) -> Shape:
    """The model of the main table: --quick's, or the default widened to --hidden (Llama-3's proportions: 64-wide
    heads, 4 query heads per K/V head, an MLP 3.5x as wide)."""
    if args.quick:
        return QUICK
    if args.hidden is None:
        return Shape(seq=args.seq, layers=args.layers)
    heads = args.hidden // 64
    return Shape(seq=args.seq, layers=args.layers, hidden=args.hidden, heads=heads, kv_heads=max(1, heads // 4),
                 intermediate=args.hidden * 7 // 2)


def run_all(args: argparse.Namespace) -> tuple[list[Result], list[str]]:
    from nxdtrain.cli import PRELOAD
    from nxdtrain.parallel.dist import spawn

    shape = shape_of(args)
    root = Path(args.workdir)
    hf = build_model(root, shape) if not args.long_only else root / "hf"
    base = dict(precision=args.precision, data="synthetic", seq_len=shape.seq, gbs=args.gbs, mbs=args.mbs,
                steps=args.warmup + args.steps, lr=1e-4, warmup=0, schedule="constant", optimizer="adamw",
                weight_decay=0.1, clip_grad=1.0, seed=1, dist_timeout=600.0, no_checkpoint=True)
    tokens = args.gbs * shape.seq
    fpt = flops_per_token(shape)
    results = []
    failed: list[str] = []

    def launch(fn: Any, fn_args: tuple[Any, ...], nprocs: int, row: str, mode: str, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        code = spawn(fn, (*fn_args, out), nprocs, timeout_s=args.timeout, preload=(*PRELOAD, "transformers"))
        if code != 0:
            print(f"{row} {mode}: failed with exit code {code}", file=sys.stderr)
            failed.append(f"{row} {mode}")
            return
        results.append(collect(out, nprocs, row, mode, tokens, fpt, args.peak_tflops))
        r = results[-1]
        print(f"{row:<14} {mode:<9} {r.tokens_per_s:9.0f} tok/s  peak {r.peak_mib:7.0f} MiB  act {r.act_mib:7.0f} MiB",
              flush=True)

    for mode in ("none", "full"):
        if mode in args.modes and not args.long_only:
            launch(hf_worker, (str(hf), base, args.steps, args.warmup, mode == "full"), 1, "transformers", mode,
                   root / f"out-hf-{mode}")
    def nxd_rows(rows: list[str], modes: list[str], hf: Path, base: dict[str, Any], label: str) -> None:
        for row in rows:
            tp, pp, dp, extra = ROWS[row]
            src = converted(hf, hf.parent, tp, pp)
            for mode in modes:
                options = {**base, **extra, "resume": str(src), "tp": tp, "pp": pp, "activation_checkpointing": mode}
                procs = tp * pp * dp * extra.get("context_parallel", 1)
                launch(nxd_worker, (options, args.steps, args.warmup), procs, row, mode,
                       root / f"out-{label}{row}-{mode}")

    if not args.long_only:
        nxd_rows(args.rows, args.modes, hf, base, "")
    if args.long_seq:
        long_shape = dataclasses.replace(LONG, seq=args.long_seq)
        long_hf = build_model(root / "long", long_shape)
        long_base = {**base, "seq_len": long_shape.seq, "gbs": 1, "mbs": 1}
        results.append(LONG_MARK)
        tokens = long_shape.seq
        fpt = flops_per_token(long_shape)
        nxd_rows(list(LONG_ROWS), ["none"], long_hf, long_base, "long-")
    return results, failed


LONG_MARK = Result("--long--", "", 0, 0.0, [], 0.0, 0.0)  # where the long-context rows start in the results


def table(results: list[Result], machine: str, args: argparse.Namespace) -> str:
    main_rows = results[:results.index(LONG_MARK)] if LONG_MARK in results else results
    long_rows = results[results.index(LONG_MARK) + 1:] if LONG_MARK in results else []
    shape = shape_of(args)
    lines = [f"machine: {machine}; {args.warmup} warmup + {args.steps} timed steps, {args.precision}", ""]
    if main_rows:
        lines += [f"model {shape}; gbs {args.gbs}, mbs {args.mbs}", ""] + _rows(main_rows, "transformers", args)
    if long_rows:
        long_shape = dataclasses.replace(LONG, seq=args.long_seq)
        lines += ["", f"long context: model {long_shape}; one row of {long_shape.seq} tokens per step, checkpointing "
                      "none; ref: the tp1 row", ""]
        lines += _rows(long_rows, "tp1", args)
    return "\n".join(lines) + "\n"


def _rows(results: list[Result], ref_row: str, args: argparse.Namespace) -> list[str]:
    ref = next((r for r in results if r.row == ref_row and r.mode == "none"), None)
    lines = ["| row | checkpointing | procs | tokens/s | x ref | peak MiB/rank | x ref | act MiB/rank | ref / act | "
             "states MiB/rank |" + (" MFU |" if args.peak_tflops else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.peak_tflops else "")]
    for r in results:
        speed = f"{r.tokens_per_s / ref.tokens_per_s:.2f}" if ref else "-"
        memory = f"{r.peak_mib / ref.peak_mib:.2f}" if ref else "-"
        act = f"{ref.act_mib / r.act_mib:.2f}" if ref and r.act_mib > 0 else "-"  # how many times less
        mfu = f" {r.mfu:.1%} |" if r.mfu is not None else ""
        states = f"{r.states_mib:.1f}" if r.states_mib else "-"
        lines.append(f"| {r.row} | {r.mode} | {r.procs} | {r.tokens_per_s:.0f} | {speed} | {r.peak_mib:.0f} | "
                     f"{memory} | {r.act_mib:.0f} | {act} | {states} |{mfu}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer 128-wide model, one step: a smoke check")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    parser.add_argument("--long-seq", type=int, default=4096, help="tokens per row of the long-context table (0: skip)")
    parser.add_argument("--long-only", action="store_true", help="run only the long-context table")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated checkpointing modes")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler over each row's timed steps: the top kernels into the row's out dir "
                             "(profile-rank<N>.txt; the timings then include the profiler's overhead)")
    parser.add_argument("--hidden", type=int, default=None,
                        help="a wider model (a multiple of 64; default 512 with 8 heads): for a GPU")
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--precision", default=None, help="fp32 (default on CPU) or bf16 (default with CUDA)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-device peak, for MFU (GPU)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one row may take")
    parser.add_argument("--workdir", default=None, help="where the model and conversions go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.profile:
        os.environ[PROFILE_ENV] = "1"
    import torch

    args.rows = [r for r in args.rows.split(",") if r]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [r for r in args.rows if r not in ROWS] + [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown row or mode {unknown[0]!r}")
    if args.quick:
        args.steps, args.warmup = 1, 1
        args.long_seq = min(args.long_seq, 512)
    args.precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    cleanup = None
    if args.workdir is None:
        cleanup = tempfile.TemporaryDirectory(prefix="bench-train-")
        args.workdir = cleanup.name
    from ckptconv.engine.options import usable_cpus

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    machine = (f"{platform.machine()}, {usable_cpus()} usable cores{gpu}, "
               f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM, torch {torch.__version__}")
    try:
        results, failed = run_all(args)
    finally:
        if cleanup is not None:
            cleanup.cleanup()
    text = table(results, machine, args)
    print("\n" + text)
    OUT.mkdir(exist_ok=True)
    (OUT / "train.md").write_text(text)
    (OUT / "train.json").write_text(json.dumps({"machine": machine, "args": {k: v for k, v in vars(args).items()},
                                                "results": [asdict(r) for r in results if r is not LONG_MARK]},
                                               indent=1, default=str))
    if failed:  # a row that did not run is not a measurement: say so in the exit status too
        print(f"failed rows: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: ckptconv, nxdtrain
    sys.exit(main())
