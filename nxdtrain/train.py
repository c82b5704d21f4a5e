"""The training loop: load a stage from NxD shards, step it, checkpoint it, export it.

:func:`train` runs in every process of the world (started by ``nxdtrain run --nproc N``,
torchrun or srun). :func:`prepare` does every check that needs no process group, so that
``--nproc`` can fail with one line before starting anything.

Example (one process; ``nxdtrain run`` is the same call):

    >>> from nxdtrain.config.options import TrainConfig
    >>> cfg = TrainConfig.from_flat({"resume": "llama-nxd", "steps": 10, "data": "synthetic",
    ...                              "seq_len": 128, "checkpoint_dir": "ckpt"})   # doctest: +SKIP
    >>> history = train(cfg)                                                      # doctest: +SKIP
    >>> history[-1].loss                                                          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptconv.cli import warnings_as_notes
from ckptconv.core import ParallelLayout
from ckptconv.engine import usable_cpus
from ckptconv.errors import ConversionError
from ckptconv.io import Flavour
from ckptconv.training import DEFAULT_RULE, lr_at
from nxdtrain.checkpoint.continuity import check_resume, new_run_id, optimizer_groups, run_settings
from nxdtrain.checkpoint.export import export
from nxdtrain.checkpoint.loss_check import refusal, verdict
from nxdtrain.checkpoint.moe_record import check_moe_resume, moe_record
from nxdtrain.checkpoint.nxd_resume import read_nxd_state
from nxdtrain.checkpoint.restore import StageReader
from nxdtrain.checkpoint.resume import (
    ResumeSource,
    TrainingState,
    read_training_state,
    resolve_start,
    resume_notes,
    run_layout,
    same_layout,
)
from nxdtrain.checkpoint.save import TagWriter, set_rng_state
from nxdtrain.checkpoint.tags import check_checkpoint_dir, check_one_writer, claim_checkpoint_dir
from nxdtrain.config.checks import check_degree
from nxdtrain.config.options import TrainConfig
from nxdtrain.config.preflight import (
    SYNTHETIC,
    check_export_target,
    check_saves,
    moe_refusal,
    synthetic_notice,
)
from nxdtrain.data.check import CheckedData, checked_rows
from nxdtrain.data.epochs import data_parallel
from nxdtrain.data.epochs import resolve as resolve_length
from nxdtrain.data.rows import Batches, RowSource, open_rows
from nxdtrain.device import Device, local_gpu_limits, resolve_kind
from nxdtrain.errors import TrainError
from nxdtrain.metrics import PendingStep, StepLog, StepMetrics, note, read_metrics, require_tensorboard
from nxdtrain.model.capacity import run_routing
from nxdtrain.model.moe import aux_loss, step_aux
from nxdtrain.model.stage import LlamaStage, grad_plan
from nxdtrain.optim import Optimizer, expert_zero
from nxdtrain.parallel.context import CpGroup, check_seq_len
from nxdtrain.parallel.dist import (
    LAUNCHER_ENV,
    Mesh,
    detect_env,
    from_rank0,
    host_group,
    init_world,
    local_world_size,
    stop_together,
)
from nxdtrain.parallel.experts import EpGroup
from nxdtrain.parallel.fsdp_run import local_all, memory_notes, on_local_rows, sharding_for, state_bytes
from nxdtrain.parallel.grads import clip_gradients, global_norm, reduce_gradients
from nxdtrain.parallel.layers import TpGroup
from nxdtrain.parallel.offload import offloading
from nxdtrain.parallel.preempt import Preemption

# What the checks of --data and of --eval-data (None: no evaluation) found: the launcher of --nproc passes them to
# its workers, so that the data is checked once, before the first process, not again on every rank.
DataChecks = tuple[CheckedData, CheckedData | None]


@dataclass(frozen=True)
class Resolved:
    """What ``--resume`` resolved to and what the tag's training state holds (None: weights only), with the lines
    reading it said: the launcher of --nproc passes it to its workers, which would otherwise each read every
    shard's header again (and parse NxD's optimizer files, for NxD's tags) for what the launcher already knows."""

    source: ResumeSource
    state: TrainingState | None
    notes: tuple[str, ...]


@dataclass(frozen=True)
class RunPlan:
    """A run checked against its checkpoint and world size, before any process group exists."""

    config: TrainConfig
    source: ResumeSource
    layout: ParallelLayout
    world_size: int
    dp: int
    microbatches: int
    rows: RowSource                     # --data, opened (and checked) once
    resume_state: TrainingState | None  # step, samples and RNG of a full checkpoint; None: start at 0
    device: str = "cpu"                 # --device resolved: cpu, cuda or xla
    precision_note: str = ""            # which precision the run uses, and why (rank 0 prints it)
    eval_rows: RowSource | None = None  # --eval-data, opened (and checked) once
    eval_count: int = 0                 # global batches per evaluation
    resume_notes: tuple[str, ...] = ()  # what the resume reshards on load, what it cannot carry, what the data check
                                        # found, what an override changed (rank 0 prints)
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # schedule and data order (nxdtrain.checkpoint.continuity)
    data_checks: DataChecks | None = None  # what the checks of --data and --eval-data found (for the workers)
    resolved: Resolved | None = None       # --resume resolved and its state read (for the workers)


def _resolve_device(config: TrainConfig) -> str:
    """The device kind the run trains on, refused (TrainError) where the run cannot use it."""
    device = resolve_kind(config.device)
    why = None
    if device == "xla":  # --device auto may resolve to xla: the same limits as an explicit --device xla
        why = config.xla_why()
        if why is None and config.nproc and config.nproc > 1:
            why = (f"--nproc {config.nproc} with --device xla: start XLA worlds with torchrun (PJRT ranks come from "
                   "it; see examples/neuron/), or use --device cpu")
    elif device == "cuda":
        why = local_gpu_limits(config.nproc)
    if why is not None:
        auto = "xla (a PJRT accelerator)" if device == "xla" else device
        raise TrainError(why if config.device == device else f"--device auto chose {auto}: {why}")
    return device


def _run_layout(config: TrainConfig, source: ResumeSource, device: str) -> tuple[ParallelLayout, TrainConfig]:
    """The run's layout (a degree not given: the shards') and the config with it, checked against the model."""
    try:
        asked = run_layout(config.parallel, source.layout, source.spec)  # not given: the shards'
        asked.check_model(source.spec)
    except ConversionError as exc:
        raise TrainError(f"{source.flag} {source.given}: this run's layout: {exc}") from None
    layout = asked.layout
    config = config.with_layout(tp=layout.tp, pp=layout.pp, ep=layout.ep)
    if device == "xla":  # --device auto's check again, now with the shards' pp where --pp was not given
        _resolve_device(config)
    return layout, config


def prepare(config: TrainConfig, world_size: int, data_checks: DataChecks | None = None,
            resolved: Resolved | None = None) -> RunPlan:
    """Resolve ``--resume``, check the layout, the batch arithmetic, the data and the output directories; raise
    TrainError. ``data_checks``: the launcher's checks of this run's data (its ``RunPlan.data_checks``): not redone;
    ``resolved``: the launcher's ``RunPlan.resolved``: the tag is not resolved and read again."""
    device = _resolve_device(config)
    check_one_writer(config.checkpoint.checkpoint_dir)  # first: a live run there is the refusal that matters
    source = resolve_start(config.checkpoint) if resolved is None else resolved.source
    given = config
    layout, config = _run_layout(config, source, device)
    tp, pp = layout.tp, layout.pp
    data = config.data
    par = config.parallel
    cp = par.context_parallel
    try:
        dp, microbatches = data_parallel(world=world_size, tp=tp, pp=pp, gbs=data.gbs, mbs=data.mbs, cp=cp)
    except TrainError as exc:  # a degree not given is the shards'; the message says so
        raise TrainError(given.layout_explained(str(exc))) from None
    if reason := check_degree(hybrid_shard=par.hybrid_shard, dp=dp):
        raise TrainError(reason)
    if reason := check_seq_len(data.seq_len, cp=cp, tp=tp, sequence_parallel=par.sequence_parallel):
        raise TrainError(reason)
    window = source.spec.window
    if cp > 1 and window is not None and window < data.seq_len:  # the family's sliding window (Mistral)
        raise TrainError(f"config.json: sliding_window {window} < --seq-len {data.seq_len} with --context-parallel "
                         f"{cp}: ring attention has no window mask; use --context-parallel 1 or rows of at most "
                         f"{window} tokens")
    if why := moe_refusal(source.spec, layout.ep, dp=dp, cp=cp, device=device, shards=par.shards,
                          optimizer_format=config.checkpoint.optimizer_format, zero1=par.zero1):
        raise TrainError(why)
    moe, moe_notes = run_routing(source.spec, config)
    if config.parallel.pp_schedule == "1f1b" and microbatches < pp:
        raise TrainError(f"--pp-schedule 1f1b needs at least --pp {pp} microbatches per data-parallel rank, got "
                         f"{microbatches} (gbs / (mbs x dp)); raise --gbs, lower --mbs or use --pp-schedule gpipe")
    rows, train_check = checked_rows(open_rows(data.data, vocab=source.spec.vocab, seq_len=data.seq_len,
                                               seed=config.seed), seq_len=data.seq_len, long_rows=data.long_rows,
                                     pad=data.pad, checked=data_checks[0] if data_checks else None)
    data_notes = list(train_check.lines)
    eval_rows, eval_count, eval_check = open_eval(config, source.spec.vocab, data_checks[1] if data_checks else None)
    epochs = config.epochs
    config = resolve_length(config, rows.size)  # --epochs -> steps, a --warmup fraction -> steps
    if config.tensorboard:
        require_tensorboard()
    if resolved is None:
        resolved = Resolved(source, *read_state(source, gbs=data.gbs))
    resume_state, nxd_notes = resolved.state, list(resolved.notes)
    # ZeRO-1 shards over dp x cp (NxD's too): that product is the optimizer state's partition size
    notes = data_notes + nxd_notes + resume_notes(source, layout, resume_state, zero1=config.parallel.zero1, dp=dp * cp,
                                      world=world_size, optimizer=config.optim.optimizer)
    run_id = (resume_state.run.get("run") if resume_state is not None else None) or new_run_id()
    record = run_settings(config, epochs=epochs, run=str(run_id))
    notes += moe_notes
    if moe is not None:  # MoE: the routing is recorded, and a resume keeps it unless --override-moe
        record["moe"] = moe_record(moe)
        if resume_state is not None:
            notes += check_moe_resume(resume_state.run.get("moe"), record["moe"],
                                      moe_record(run_routing(source.spec, None)[0] or moe), tag=str(source.root),
                                      override=config.moe.override_moe)
    if resume_state is not None:  # the schedule and data order the tag recorded, or a refusal
        notes += check_resume(resume_state.run, resume_state.missing, record, tag=str(source.root),
                              override=config.checkpoint.override_schedule)
    recorded = resume_state.options.get("precision") if resume_state is not None else None
    config, precision_note = config.with_precision(device, recorded)
    if config.checkpoint.optimizer_format == "nxd" and config.precision == "bf16" and not config.parallel.zero1:
        raise TrainError("--optimizer-format nxd with --precision bf16 needs --zero1 (with --shard-params, which "
                         "replaces --zero1: --optimizer-format nxdtrain): NxD keeps a bf16 run's fp32 masters and "
                         "moments only in its ZeRO-1 optimizer's files")
    if config.checkpoint.optimizer_format == "nxd" and config.precision == "bf16" and layout.ep > 1:
        raise TrainError(f"--optimizer-format nxd with --ep {layout.ep} and --precision bf16: NxD's expert-parallel ZeRO-1 "
                         "files hold no fp32 masters, so each save would lose them; use --precision fp32 or "
                         "--optimizer-format nxdtrain")
    # The outputs last: what the run writes, checked before its first step (not after the last one).
    check_saves(config)
    check_checkpoint_dir(config.checkpoint.checkpoint_dir, resume_state.step if resume_state else 0)
    if config.export_hf:
        check_export_target(config.export_hf, "--export-hf")
    return RunPlan(config, source, layout, world_size, dp, microbatches, rows, resume_state, device, precision_note,
                   eval_rows, eval_count, tuple(notes), record, (train_check, eval_check), resolved)


def prepare_in_world(config: TrainConfig, world_size: int) -> RunPlan:
    """:func:`prepare` in a world started by torchrun or srun (its process group joined): rank 0 does what the
    launcher of --nproc does (resolves --resume, reads every shard's header and the training state, checks the
    data) and hands ``RunPlan.resolved`` and ``data_checks`` to the others, which plan with them and open no file
    of the tag here (each checks its own shards as it reads them). One rank for the whole world, not one per host:
    the answer is a few KB to MB of pickled state, while every further reader multiplies the shared file system's
    header reads. A refusal on rank 0 (or on any rank's own prepare) is raised on every rank."""
    first: list[RunPlan] = []

    def as_launcher() -> tuple[DataChecks | None, Resolved | None]:
        first.append(prepare(config, world_size))
        return first[0].data_checks, first[0].resolved

    group = host_group(config.dist_timeout)
    try:
        checks, resolved = from_rank0(as_launcher, group)
        failure = None
        if not first:
            try:
                first.append(prepare(config, world_size, checks, resolved))
            except Exception as exc:  # a refusal only this rank meets (a file its host lacks): every rank stops
                failure = exc
        # Also the barrier that keeps rank 0 from claiming --checkpoint-dir (train) while another rank's prepare
        # still checks that no live run holds it.
        stop_together(failure, group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    return first[0]


def read_state(source: ResumeSource, *, gbs: int) -> tuple[TrainingState | None, tuple[str, ...]]:
    """The training state of a full resume's tag (None: weights only) and the lines that say how it was read."""
    if source.full and source.nxd:  # a tag of NxD's own code: its side files mapped (nxdtrain.checkpoint.nxd_resume)
        state, lines = read_nxd_state(source.root, source.checks(), gbs=gbs)
        return state, tuple(lines)
    if source.full:
        state = read_training_state(source.root, source.checks(), gbs=gbs)
        return state, tuple(state.notes)
    return None, ()


def open_eval(config: TrainConfig, vocab: int,
              checked: CheckedData | None = None) -> tuple[RowSource | None, int, CheckedData | None]:
    """``--eval-data``, how many global batches each evaluation takes (all full ones, or --eval-batches) and what
    its check found (``checked``: found already)."""
    data = config.data
    if not data.eval_every or not data.eval_data:
        return None, 0, None
    # A different seed: synthetic held-out rows must not be the training rows.
    rows, eval_check = checked_rows(open_rows(data.eval_data, vocab=vocab, seq_len=data.seq_len, seed=config.seed + 1),
                                    seq_len=data.seq_len, long_rows=data.long_rows, pad=data.pad, checked=checked)
    whole = None if rows.size is None else rows.size // data.gbs
    if whole is None and data.eval_batches is None:
        raise TrainError("--eval-data synthetic has no end: give --eval-batches N")
    if whole == 0:
        raise TrainError(f"--eval-data {data.eval_data}: {rows.size} rows, fewer than one global batch of --gbs "
                         f"{data.gbs}")
    count = data.eval_batches if whole is None else min(whole, data.eval_batches or whole)
    assert count is not None
    return rows, count, eval_check


class Trainer:
    """One rank's model stage, optimizer, pipeline and data; :meth:`run` trains to ``--steps``."""

    def __init__(self, plan: RunPlan, device: Device) -> None:
        cfg, source = plan.config, plan.source
        self.plan, self.cfg, self.dev, self.device = plan, cfg, device, device.torch_device
        self.mesh = mesh = Mesh(tp=plan.layout.tp, pp=plan.layout.pp, cp=cfg.parallel.context_parallel,
                                ep=plan.layout.ep, timeout_s=cfg.dist_timeout)
        self.rank0 = mesh.rank == 0
        c = mesh.coords
        torch.manual_seed(cfg.seed)
        par = cfg.parallel
        # Sharded (FSDP2), the parameters are the fp32 masters; its MixedPrecisionPolicy computes in bf16.
        dtype = torch.bfloat16 if cfg.precision == "bf16" and not par.shards else torch.float32
        tp = TpGroup(mesh.tp, c.tp, mesh.tp_group, sequence_parallel=par.sequence_parallel and mesh.tp > 1)
        cp = CpGroup(mesh.cp, c.cp, mesh.cp_group, tuple(mesh.cp_ranks))
        # MoE: this rank's experts and their groups (collective), the router's aux loss; a dense model: none
        self.experts: tuple[Any, Any] | None
        ep, self.experts = mesh.experts() if source.spec.experts else (EpGroup(), None)
        moe = run_routing(source.spec, cfg)[0]
        aux = aux_loss(source.spec, cfg.data, inject=c.tp == 0, routing=moe)
        self.model = LlamaStage(source.spec, plan.layout, tp=tp, pp_rank=c.pp, with_inv_freq=source.with_inv_freq,
                                dtype=dtype, recompute=par.activation_checkpointing, cp=cp,
                                recompute_modules=par.modules(), ep=ep, aux=aux, routing=moe).to(self.device)
        # ep > 1: a rank's tensors come from two files (ep rank 0's and its own experts'), through the plan
        resharding = not same_layout(source.layout, plan.layout) or plan.layout.ep > 1
        stage = StageReader(source, plan.layout, tp_rank=c.tp, pp_rank=c.pp, ep_rank=ep.rank,
                            optimizer=source.full) if resharding or source.full or source.nxd else None
        try:
            if stage is not None and (resharding or source.nxd):  # NxD's tags: the masters may be the weights
                state, where = stage.weights(), f"{source.root}" + (" (resharded on load)" if resharding else "")
            else:
                state, where = source.load_state(c.tp, c.pp), str(source.shard(c.tp, c.pp))
            self.model.load_shard_state(state, where)
            self.sharding = sharding_for(self.model, cfg, mesh, self.device)
            zero_group = mesh.dpcp_group if cfg.parallel.zero1 else None  # NxD's zero1 shards over dp x cp too
            self.optimizer = Optimizer(self.model, cfg.optim, initial=state, zero_group=zero_group,
                                       capturable=device.is_xla, experts=expert_zero(self.model, self.experts,
                                                                                     zero_group))
            del state
            self.step, self.consumed = 0, 0
            self.saved_step: int | None = None
            self.optimizer_notes: list[str] = []  # what --override-schedule changed of the tag's AdamW (_restore)
            self.last_loss: float | None = None  # the newest logged loss (a tag records it: nxdtrain.checkpoint.loss_check)
            if source.full:
                assert stage is not None
                self._restore(stage)
            if stage is not None:
                stage.finish()
        finally:
            if stage is not None:
                stage.close()
        self.grad_plan = on_local_rows(grad_plan(self.model, mesh, source.spec, plan.layout, self.experts),
                                       self.sharding, self.model)
        self.state_bytes: dict[str, int] | None = None  # model states on this rank (measured in the first step)
        from nxdtrain.model.pipeline import PipelineStep  # torch.distributed.pipelining takes seconds to import

        data = cfg.data
        self.pipeline = PipelineStep(self.model, pp_group=mesh.pp_group, pp_size=mesh.pp,
                                     microbatches=plan.microbatches, schedule=cfg.parallel.pp_schedule,
                                     tokens_per_batch=data.gbs * (data.seq_len - 1), device=self.device,
                                     mbs=data.mbs, seq_len=data.seq_len)
        self.batches = Batches(plan.rows, seq_len=data.seq_len, shuffle=data.shuffle, seed=cfg.seed,
                               vocab=source.spec.vocab, gbs=data.gbs, pad=data.pad)
        self.eval_batches = None if plan.eval_rows is None else Batches(
            plan.eval_rows, seq_len=data.seq_len, shuffle=False, seed=cfg.seed, vocab=source.spec.vocab, pad=data.pad)
        ckpt = cfg.checkpoint
        self.writer = None if not ckpt.checkpoint_dir else TagWriter(
            root=Path(ckpt.checkpoint_dir), source=source, layout=plan.layout, coords=c, zero1=zero_group is not None,
            flavour=Flavour.XSER_SPLIT if ckpt.xser else Flavour.PLAIN, keep=ckpt.keep, options=cfg.to_flat(),
            record=plan.record, host_group=mesh.host_group, zero_rank=mesh.dpcp_rank,
            zero_size=mesh.dp * mesh.cp, nxd_zero1=cfg.parallel.zero1,
            nxd_param_groups=(ckpt.nxd_param_groups or ("bias" if cfg.optim.norm_weight_decay else DEFAULT_RULE))
            if ckpt.optimizer_format == "nxd" else None, sharding=self.sharding, host_state=self.device.type == "cpu",
        )
        device.sync()  # the loaded state becomes device data before the first step's graph
        if self.rank0:
            self._announce()

    def _announce(self) -> None:
        """What rank 0 says before the first step: device, precision, data, resume, layout and where it starts."""
        cfg, plan, mesh = self.cfg, self.plan, self.mesh
        note(self.dev.describe())
        note(plan.precision_note)
        if (notice := synthetic_notice(cfg)) is not None:
            note(notice)
        note(f"resume: {plan.source.case}")
        for line in (*plan.resume_notes, *self.optimizer_notes, *memory_notes(self.sharding, cfg, mesh.dp,
                                                                               self.device)):
            note(line)
        note(f"{mesh.describe()}; layout {plan.layout.to_json()}; {plan.microbatches} microbatch(es) of "
             f"{cfg.data.mbs} per dp rank; starting at step {self.step} of {cfg.steps} "
             f"(warmup {cfg.optim.warmup:g} steps)")

    def _restore(self, stage: StageReader) -> None:
        """Optimizer state, fp32 masters, step, data position and RNG of a full checkpoint."""
        state = self.plan.resume_state
        assert state is not None  # a full checkpoint
        same = state.options.get("optimizer", self.cfg.optim.optimizer) == self.cfg.optim.optimizer
        groups, self.optimizer_notes = optimizer_groups(
            stage.hyper.param_groups, self.cfg.optim, self.cfg.given, tag=str(self.plan.source.root),
            override=self.cfg.checkpoint.override_schedule) if same else (stage.hyper.param_groups, [])
        read = stage.optimizer_state if self.sharding is None else self.sharding.reader(stage.optimizer_state,
                                                                                         self.optimizer.master)
        self.optimizer.load_state(read, groups, same_optimizer=same)
        self.step, self.consumed = state.step, state.consumed_samples
        self.saved_step = state.step
        if len(state.rng) == self.mesh.world:
            set_rng_state(state.rng[self.mesh.rank])

    def train_step(self, step: int) -> PendingStep:
        """One optimizer step; on xla one graph, traced here and run at the sync at its end (no host reads)."""
        cfg, mesh = self.cfg, self.mesh
        ids = self.batches.dp_slice(consumed=self.consumed, gbs=cfg.data.gbs, dp_rank=mesh.coords.dp, dp=mesh.dp)
        with offloading(cfg.parallel.offload_activations, self.device):
            loss = self.pipeline.run(ids.to(self.device))
        aux = None if self.model.aux is None else step_aux(self.model.aux, mesh.pp_group if mesh.pp > 1 else None,
                                                         mesh.dpcp_group, self.device)
        grads = local_all(self.optimizer.grads(), self.sharding)  # sharded: this rank's rows (views of the gradients)
        reduce_gradients(grads, self.grad_plan)
        norm = global_norm(grads, self.grad_plan)
        clip_gradients(grads, norm, cfg.optim.clip_grad)
        lr = lr_at(step, cfg.optim, decay_steps=cfg.decay_steps)
        if self.writer is not None:  # a CPU run's --async-save writes the parameters and optimizer state the step
            self.writer.fence()      # changes: its writes finish first (nothing before the step changes them)
        self.optimizer.step(self.dev.lr(lr))
        if self.state_bytes is None:
            self.state_bytes = state_bytes(self.model, self.optimizer, self.sharding)
        self.optimizer.zero_grad()
        self.sum_loss(loss)
        masters = self.optimizer.master
        param_norm = global_norm(local_all({name: masters[name].detach() for name in self.optimizer.names},
                                           self.sharding), self.grad_plan)
        self.dev.sync()  # xla: the step's graph ends here, at the same point every step
        self.step, self.consumed = step, self.consumed + cfg.data.gbs
        return PendingStep(step, loss, lr, norm, self.consumed, param_norm, aux_loss=aux)

    def sum_loss(self, loss: torch.Tensor) -> None:
        """In place: a loss summed over dp x cp, from the last stage of each replica (where it lives) to every rank."""
        for group in (self.mesh.dpcp_group, self.mesh.pp_group):
            if group is not None:
                dist.all_reduce(loss, group=group)

    def evaluate(self) -> torch.Tensor:
        """Mean token loss over the evaluation batches (every rank takes part: tp, pp and dp, as in training)."""
        cfg, mesh, plan = self.cfg, self.mesh, self.plan
        assert self.eval_batches is not None
        gbs = cfg.data.gbs
        total = torch.zeros((), device=self.device)
        with torch.no_grad():
            for k in range(plan.eval_count):
                ids = self.eval_batches.dp_slice(consumed=k * gbs, gbs=gbs, dp_rank=mesh.coords.dp, dp=mesh.dp)
                total = total + self.pipeline.evaluate(ids.to(self.device))
        self.sum_loss(total)  # as the training loss
        self.dev.sync()
        return total / plan.eval_count

    def check_first_loss(self) -> None:
        """One forward of the first batch before step 1; stop when it says the weights were loaded wrong
        (:mod:`nxdtrain.checkpoint.loss_check`). Collective: every rank sees the same loss and stops alike."""
        cfg, mesh = self.cfg, self.mesh
        if cfg.checkpoint.allow_high_loss or cfg.data.data == SYNTHETIC:
            return
        ids = self.batches.dp_slice(consumed=self.consumed, gbs=cfg.data.gbs, dp_rank=mesh.coords.dp, dp=mesh.dp)
        with torch.no_grad():
            loss = self.pipeline.evaluate(ids.to(self.device))
        self.sum_loss(loss)  # as the training loss
        value = float(loss)
        state = self.plan.resume_state
        recorded = state.loss if state is not None else None
        why = verdict(value, vocab=self.plan.source.spec.vocab, recorded=recorded)
        if why is not None:
            raise TrainError(refusal(why, f"{self.plan.source.flag} {self.plan.source.given}",
                                     experts=bool(self.plan.source.spec.experts)))
        if self.rank0:
            note(f"first batch loss {value:.3f} before step {self.step + 1} (ln vocab {math.log(self.plan.source.spec.vocab):.3f}"
                 + (f", the tag recorded {recorded:.3f}" if recorded is not None else "") + "): the weights load as trained")

    def save(self, background: bool | None = None) -> Path:
        """Save this step (``background``: --async-save by default; the tag completes at :meth:`finish_save`)."""
        assert self.writer is not None
        background = self.cfg.checkpoint.async_save if background is None else background
        self.finish_save()  # one save in flight at most
        scheduler = {"schedule": self.cfg.optim.schedule, "lr": self.cfg.optim.lr, "min_lr": self.cfg.optim.min_lr,
                     "warmup": self.cfg.optim.warmup, "decay_steps": self.cfg.decay_steps,
                     "last_lr": lr_at(max(1, self.step), self.cfg.optim, decay_steps=self.cfg.decay_steps)}
        tag = self.writer.save(step=self.step, consumed=self.consumed, model=self.model, optimizer=self.optimizer,
                               scheduler=scheduler, loss=self.last_loss, background=background)
        self.saved_step = self.step
        if self.rank0:
            note(f"saving {tag} in the background" if background else f"saved {tag}")
        return tag

    def finish_save(self) -> None:
        """Complete the save in flight (--async-save), if any: collective, at a save, the run's end or a stop."""
        tag = None if self.writer is None or self.writer.pending is None else self.writer.pending.tag
        waited = None if self.writer is None else self.writer.complete()
        if self.rank0 and waited is not None:
            note(f"saved {tag}" + (f" (waited {waited:.2f} s for its writes)" if waited >= 0.01 else ""))

    def run(self, stop: Preemption | None = None) -> tuple[list[StepMetrics], Path | None]:
        """Train to ``--steps``, or until ``stop`` is agreed (nxdtrain.parallel.preempt: at a step boundary, never
        inside a save, no save after it); return the per-step metrics and the last tag written (if any)."""
        cfg = self.cfg
        stop = stop or Preemption(self.mesh.host_group, self.device)
        freq = cfg.checkpoint.checkpoint_freq
        start = self.step
        if start < cfg.steps:  # before the log is opened: a stopped start writes nothing
            self.check_first_loss()
        log = StepLog(first_step=start, last_step=cfg.steps, jsonl=cfg.log_jsonl, enabled=self.rank0,
                      tensorboard=cfg.tensorboard, seq_len=cfg.data.seq_len)
        history: list[StepMetrics] = []
        pending: list[PendingStep] = []
        last_tag = None
        tokens_per_step = cfg.data.gbs * cfg.data.seq_len
        try:
            started = time.perf_counter()
            every = cfg.data.eval_every
            for step in range(start + 1, cfg.steps + 1):
                if stop.requested():
                    break
                pending.append(self.train_step(step))
                if every and step % every == 0:
                    evaluating = time.perf_counter()
                    pending[-1] = dataclasses.replace(pending[-1], eval_loss=self.evaluate())
                    started += time.perf_counter() - evaluating  # tokens/s counts training only
                saving = self.writer is not None and freq and step % freq == 0
                if saving or step % cfg.log_every == 0 or step == cfg.steps:  # host reads only here
                    for metrics in read_metrics(pending, started, tokens_per_step):
                        history.append(metrics)
                        log.record(metrics)
                        self.last_loss = metrics.loss
                    pending = []
                if saving and stop.requested():
                    break
                if saving:
                    last_tag = self.save()
                if not pending:  # tokens/s counts training only, not logging or saving
                    started = time.perf_counter()
        finally:
            log.close()
        if stop.agreed:  # stopped: no save starts after the signal; the one in flight completes
            self.finish_save()
            return history, last_tag
        if self.writer is not None and self.saved_step != self.step:  # the final state is always saved
            last_tag = self.save()
        self.finish_save()
        if self.rank0 and self.step == start:
            note(f"nothing to train: the checkpoint is at step {start}, --steps is {cfg.steps}")
        return history, last_tag


def train(config: TrainConfig, data_checks: DataChecks | None = None,
          resolved: Resolved | None = None) -> list[StepMetrics]:
    """Train in this process as one rank of the launcher's world (or alone); export at the end if asked.
    ``data_checks``, ``resolved``: what the launcher's checks of the data and of --resume found (:func:`prepare`)."""
    env = detect_env()
    if env.world_size > 1 and resolved is None:  # torchrun/srun: no launcher read the tag before the world started
        device = init_world(env, config.dist_timeout, resolve_kind(config.device))
        plan = prepare_in_world(config, env.world_size)
    else:
        plan = prepare(config, env.world_size, data_checks, resolved)
        device = init_world(env, config.dist_timeout, plan.device)
    torch.set_num_threads(max(1, usable_cpus() // local_world_size()))  # the cores we may use, shared
    directory = config.checkpoint.checkpoint_dir
    lock = None
    try:
        if env.rank == 0 and directory:  # one writer per checkpoint directory, for the whole run
            launcher = os.environ.get(LAUNCHER_ENV)
            lock = claim_checkpoint_dir(directory, f"nxdtrain run --checkpoint-dir {directory} (rank 0 of "
                                                   f"{env.world_size}{f', launcher pid {launcher}' if launcher else ''})")
        trainer = Trainer(plan, device)
        with Preemption(trainer.mesh.host_group, trainer.device) as stop:  # SIGTERM/SIGINT: every rank, one step
            history, last_tag = trainer.run(stop)
            if stop.agreed and env.rank == 0:  # before the barrier: the launcher may end rank 0 once the others exit
                note(f"{signal.Signals(stop.agreed).name}: every rank stopped after step {trainer.step}; the newest "
                     "tag with a 'done' marker holds the run")
            dist.barrier(group=trainer.mesh.host_group)
    finally:
        dist.destroy_process_group()
        if lock is not None:
            lock.release()
    if stop.agreed:  # 128 + the signal, as a process the signal ended; nothing exported
        raise SystemExit(128 + stop.agreed)
    if env.rank == 0 and config.export_hf:
        target = last_tag or Path(config.checkpoint.checkpoint_dir or "")
        with warnings_as_notes("nxdtrain", quiet=False):  # in a process of --nproc too: a note, not a UserWarning
            export(target, config.export_hf, label="--export-hf")
        note(f"exported {target} to {config.export_hf}")
    return history


def run_worker(config: TrainConfig, data_checks: DataChecks | None = None, resolved: Resolved | None = None) -> None:
    """Entry point of a process started by ``--nproc`` (:func:`nxdtrain.parallel.dist.spawn` reports its error once); the
    data was checked and --resume resolved by the launcher (``data_checks``, ``resolved``)."""
    train(config, data_checks, resolved)
