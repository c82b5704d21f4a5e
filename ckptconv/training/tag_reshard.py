"""``ckptconv reshard`` of a training tag: the optimizer files and side files beside the resharded shards.

The shards' plan is extended by one format-2 optimizer file per target (tp, pp, dp) rank
(:func:`ckptconv.training.nxdtrain_format.state.plan_optimizer_files`), written by the same executor in bands: memory stays
within ``--max-memory`` however large the state. The replicas the weights must agree on (K/V heads under
kv_size_multiplier, norms, a tied head) are checked for every moment too. ``scheduler.pt`` is copied,
``user_content.pt`` rewritten for the new layout, and the ``checkpoint``/``done`` markers written last.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptconv.core.layout import ParallelLayout
from ckptconv.core.mapping import live_module_order
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import NESTED_TORCH, OutFile, Plan
from ckptconv.engine.finalize import FinalizeSpec
from ckptconv.engine.options import NXD_TRAINERS
from ckptconv.engine.tags import complete_as_tag, run_record
from ckptconv.errors import ConversionError
from ckptconv.io.checked import check_whole_file
from ckptconv.io.nxd_read import NxdCheckpoint
from ckptconv.io.nxd_write import TorchZipSink, XserSplitSink
from ckptconv.io.safe_load import load_small_bytes
from ckptconv.training.nxd_format.as_source import NxdTagOptimizer
from ckptconv.training.nxd_format.position import NxdPosition, nxd_position
from ckptconv.training.nxd_format.ranks import OptimFormat
from ckptconv.training.nxd_format.read import NxdOptimizer
from ckptconv.training.nxd_format.side_files import NXD_EXAMPLE, NXDT, SideFiles, from_nxd_tag, from_nxdtrain
from ckptconv.training.nxd_format.write import (
    NXD_OPTIMIZER_KEY,
    NxdOptimizerPlan,
    WindowReader,
    index_order,
    nxd_groups,
    plan_nxd_optimizer_files,
)
from ckptconv.training.nxd_format.write_ep import plan_nxd_ep_optimizer_files
from ckptconv.training.nxdtrain_format.state import (
    OPTIM_DIR,
    SCHEDULER_FILE,
    USER_CONTENT_FILE,
    OptimizerSource,
    TagOptimizer,
    TagReader,
    describe_zero1,
    lm_head_copy_of,
    plan_optimizer_files,
    resharded_user_content,
    state_replicas,
)


def _checked(ckpt: NxdCheckpoint, path: Path) -> bytes:
    """A side file's bytes, as recorded (--no-check: as they are): side files are carried only so."""
    if not path.is_file():
        raise ConversionError(f"{path}: missing from the training tag; pass --weights-only for the shards alone")
    return check_whole_file(path, ckpt.checks.record(path) if ckpt.checks.enabled else None)


def _load(ckpt: NxdCheckpoint, path: Path) -> Any:
    try:
        return load_small_bytes(_checked(ckpt, path), str(path))
    except ValueError as exc:
        raise ConversionError(str(exc)) from None


def _placement(optim: OptimizerSource, dp: int | None, zero1: bool | None) -> tuple[bool, int]:
    """(ZeRO-1 on, dp ranks of the target's optimizer files): the flags, else the tag's own."""
    on = optim.hyper.zero1 if zero1 is None else zero1
    size = (optim.hyper.zero_size if optim.hyper.zero1 else 1) if dp is None else dp
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        optim.close()
        raise ConversionError(f"--dp must be an integer >= 1, got {size!r}")
    return on, size if on else 1


def check_nxd_trainer(optimizer_format: str, trainer: str | None) -> None:
    """``--nxd-trainer`` applies to ``--optimizer-format nxd`` only, and names one of NXD_TRAINERS."""
    if trainer is None:
        return
    if trainer not in NXD_TRAINERS:
        raise ConversionError(f"--nxd-trainer must be one of {', '.join(NXD_TRAINERS)}, got {trainer!r}")
    if optimizer_format != "nxd":
        raise ConversionError(f"--nxd-trainer {trainer} applies to --optimizer-format nxd only")


@dataclass(frozen=True)
class NxdFormat:
    """``--optimizer-format nxd``: the param-group rule of the run that will load the tag, and whether a bf16
    model's fp32 state may be dropped (ZeRO-1 off); the model (its live parameter order)."""

    rule: str
    drop_masters: bool
    spec: ModelSpec
    with_inv_freq: bool
    trainer: str | None = None  # --nxd-trainer: whose side files (None: the source's own, else nxd-example)
    out: Path | None = None     # the tag written (NxDT's name, its callbacks' paths)


def in_live_order(shard: OutFile, fmt: NxdFormat, layout: ParallelLayout) -> OutFile:
    """A planned model shard as NxD's own save writes it: its keys in a live NxD model's parameter order (NxD's
    optimizer indices follow it), not the official converter's (fused qkv at the end), every tensor row-major."""
    ranks = shard.shard_id
    order = live_module_order(fmt.spec, replace(layout, with_inv_freq=fmt.with_inv_freq), tp_rank=ranks.tp,
                              pp_rank=ranks.pp)
    by_key = {t.key: t for t in shard.tensors}
    if set(order) != set(by_key):  # a tied model's shards without lm_head, an ep rank > 0's experts: the order kept
        order = [k for k in order if k in by_key] + [k for k in by_key if k not in order]
    # row-major, as NxD's own save holds every tensor (the official converter's column-major o_proj is not NxD's)
    return replace(shard, tensors=tuple(replace(by_key[k], column_major=False) for k in order))


@dataclass
class TrainingTag:
    """A training tag being resharded: its optimizer files opened, the target's dp and ZeRO-1 chosen."""

    ckpt: NxdCheckpoint
    optim: OptimizerSource
    user_content: dict[str, Any]
    dp: int
    zero1: bool
    scheduler_record: dict[str, Any] | None = None  # scheduler.pt to write; None: the tag's copied
    source_notes: tuple[str, ...] = ()               # what the source's side files could not say
    nxd_format: NxdFormat | None = None              # write NxD's optimizer format instead of nxdtrain's
    written: NxdOptimizerPlan | None = None          # what extend() planned in NxD's format (checked after)
    position: NxdPosition | None = None              # NxD's tag: its side files as read

    @classmethod
    def open(cls, ckpt: NxdCheckpoint, spec: ModelSpec, old: ParallelLayout, *,
             dp: int | None, zero1: bool | None, io: str, optim: TagOptimizer | None = None,
             only: set[tuple[int, int]] | None = None) -> TrainingTag:
        """``optim``: the tag's optimizer files, where they are open already (the weights from their masters);
        ``only``: open just the files of these (tp, pp) ranks (a part: :meth:`TagOptimizer.widen` adds its own)."""
        path = ckpt.root / USER_CONTENT_FILE
        _checked(ckpt, ckpt.root / SCHEDULER_FILE)
        content = _load(ckpt, path)
        if not isinstance(content, dict) or "step" not in content:
            raise ConversionError(f"{path}: not nxdtrain's user content (expected a dict with 'step')")
        optim = optim or TagOptimizer(ckpt.root, spec, old, lm_head_copy=lm_head_copy_of(ckpt, spec, old), checks=ckpt.checks, io=io,
                                      only=only)
        on, size = _placement(optim, dp, zero1)
        return cls(ckpt, optim, content, size, on)

    @classmethod
    def open_nxd(cls, ckpt: NxdCheckpoint, *, dp: int | None, zero1: bool | None, io: str) -> TrainingTag:
        """A tag of NxD's own code (``optim/`` in NxD's format): its optimizer read through
        :class:`~ckptconv.training.nxd_format.as_source.NxdTagOptimizer`, its side files mapped by
        :mod:`ckptconv.training.nxd_format.position` into nxdtrain's ``user_content.pt`` and ``scheduler.pt``."""
        nxd = ckpt.nxd_optimizer or NxdOptimizer(ckpt, io=io, check=ckpt.checks.enabled)  # parsed for the weights?
        try:
            optim = NxdTagOptimizer(nxd)
            position = nxd_position(ckpt.root, nxd.step(), lambda path: _load(ckpt, path))
            on, size = _placement(optim, dp, zero1)
        except BaseException:
            nxd.close()
            raise
        options = {"precision": optim.precision, "optimizer": "adamw",
                   "zero1": nxd.format is not OptimFormat.ADAMW}
        content: dict[str, Any] = {"step": position.step, "rng": [], "options": options}
        notes = list(position.notes)
        if position.consumed is not None:
            content["consumed_samples"] = position.consumed
        else:  # nxdtrain's resume continues at step x --gbs and says so
            content["consumed_samples"] = None
            notes.append(f"NxD's tag records no consumed samples: nxdtrain's resume continues the data at step "
                         f"{position.step} x its --gbs")
        missing = [k for k in ("schedule", "lr", "min_lr", "warmup", "decay_steps") if k not in position.record]
        if missing:
            notes.append(f"not carried: {', '.join(missing)} ({position.scheduler_from or 'no scheduler state'} does "
                         "not record them): a resume uses its own flags and says so")
        return cls(ckpt, optim, content, size, on, {**position.record, "step": position.step}, tuple(notes),
                   position=position)

    def source_trainer(self) -> str:
        """The trainer whose side files the source has: NxDT's for an NxDT tag, else NxD's examples'."""
        return NXDT if self.position is not None and self.position.kind == "NxDT" else NXD_EXAMPLE

    def scheduler(self) -> dict[str, Any]:
        """``scheduler.pt``: the run's schedule (schedule, lr, min_lr, warmup, decay_steps) at its step."""
        if self.scheduler_record is not None:
            return dict(self.scheduler_record)
        path = self.ckpt.root / SCHEDULER_FILE
        record = _load(self.ckpt, path)
        if not isinstance(record, dict):
            raise ConversionError(f"{path}: not nxdtrain's scheduler record (expected a dict)")
        return record

    def __enter__(self) -> TrainingTag:
        return self

    def __exit__(self, *exc: object) -> None:
        self.optim.close()

    def identity(self) -> list[tuple[Any, ...]]:
        """What identifies the tag's other inputs cheaply (the fingerprint of a rerun)."""
        files = sorted((self.ckpt.root / OPTIM_DIR).rglob("*")) + [self.ckpt.root / SCHEDULER_FILE,
                                                                  self.ckpt.root / USER_CONTENT_FILE]
        fmt: tuple[Any, ...] = (("nxd", self.nxd_format.rule, int(self.nxd_format.drop_masters),
                                 self.nxd_format.trainer or self.source_trainer())
                                if self.nxd_format else ("nxdtrain",))
        return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()] + [
            ("dp", self.dp, int(self.zero1)), fmt]

    def extend(self, plan: Plan, spec: FinalizeSpec, new: ParallelLayout, notes: list[str]) -> tuple[Plan, Any]:
        """The plan with the optimizer files; ``spec`` with the side files and markers; the reader of both."""
        if self.nxd_format is not None:
            return self._extend_nxd(plan, spec, new, notes, self.nxd_format)
        optim_files = plan_optimizer_files(plan.files, self.optim, dp=self.dp, zero1=self.zero1)
        replicas = plan.replicas + state_replicas(plan.replicas, self.optim)
        content = resharded_user_content(self.user_content, new, zero1=self.zero1)
        side: dict[str, Any] = {USER_CONTENT_FILE: content}
        if self.scheduler_record is not None:
            side[SCHEDULER_FILE] = self.scheduler_record
        complete_as_tag(spec, side=side, record=run_record(content["step"], content.get("consumed_samples")),
                        copies=[] if self.scheduler_record is not None else [
                            (str((self.ckpt.root / SCHEDULER_FILE).resolve()), SCHEDULER_FILE)])
        hyper = self.optim.hyper
        was, now = (describe_zero1(on, size, off="without ZeRO-1")
                    for on, size in ((hyper.zero1, hyper.zero_size), (self.zero1, self.dp)))
        source = "NxD's own training tag mapped to nxdtrain's format 2: " if self.scheduler_record is not None else ""
        notes.append(f"{source}training tag at step {content['step']}: optimizer state ({', '.join(hyper.components) or 'none'}) "
                     f"moved with the weights, {was} -> {now}; RNG states dropped "
                     "(they belong to the old world's ranks)")
        notes.extend(self.source_notes)
        return Plan(plan.files + optim_files, replicas), TagReader(self.ckpt, self.optim)

    def _extend_nxd(self, plan: Plan, spec: FinalizeSpec, new: ParallelLayout, notes: list[str],
                    fmt: NxdFormat) -> tuple[Plan, Any]:
        """As :meth:`extend`, in NxD's own format (:mod:`ckptconv.training.nxd_format.write`): NxD's tag keeps its own
        ``scheduler.pt``/``user_content.pt`` (copied as they are) and param groups' lrs; nxdtrain's tag gets NxD's
        ``CosineAnnealing`` state and NxD's example keys, its own position kept under ``nxdtrain``."""
        from_nxd = self.scheduler_record is not None
        step = int(self.user_content["step"])
        trainer = fmt.trainer or self.source_trainer()
        side = self._side_files(trainer, len(nxd_groups(["weight"], fmt.rule)), fmt, new)  # refusals first
        lr = side.lr
        written_notes: list[str] = []
        model_files = [in_live_order(f, fmt, new) for f in plan.files]
        planner = plan_nxd_ep_optimizer_files if new.ep > 1 else plan_nxd_optimizer_files  # NeuronEPZero1Optimizer's
        optim_files, written = planner(model_files, self.optim, dp=self.dp, zero1=self.zero1, rule=fmt.rule,
                                       drop_masters=fmt.drop_masters, lr=lr, notes=written_notes)
        self.written = written
        replicas = plan.replicas + state_replicas(plan.replicas, self.optim)
        for name in side.copies:
            _checked(self.ckpt, self.ckpt.root / name)
        complete_as_tag(spec, side=side.blobs, record=run_record(step, side.consumed),
                        copies=[(str((self.ckpt.root / name).resolve()), name) for name in side.copies],
                        **{NXD_OPTIMIZER_KEY: {**written.to_json(), "trainer": trainer}})
        hyper = self.optim.hyper
        was, now = (describe_zero1(on, size, off="without ZeRO-1")
                    for on, size in ((hyper.zero1, hyper.zero_size), (self.zero1, self.dp)))
        source = "NxD's own training tag" if from_nxd else "nxdtrain's training tag"
        notes.append(f"{source} at step {step} -> NxD's optimizer format ({written.rule}: "
                     f"{'NeuronZero1Optimizer' if self.zero1 else 'torch AdamW'} state dicts, {was} -> {now}, "
                     f"optimizer dtype {written.dtype}, masters {written.masters})")
        notes.extend(side.notes)
        notes.extend(written_notes)
        notes.extend(self.source_notes if not from_nxd else ())
        return Plan(model_files + optim_files, replicas), WindowReader(TagReader(self.ckpt, self.optim))

    def _side_files(self, trainer: str, groups: int, fmt: NxdFormat, new: ParallelLayout) -> SideFiles:
        """The side files for ``trainer`` (:mod:`ckptconv.training.nxd_format.side_files`), refused before a byte is written."""
        assert fmt.out is not None
        if self.position is None:  # nxdtrain's tag: its record at the new layout
            content = resharded_user_content(self.user_content, new, zero1=self.zero1)
            return from_nxdtrain(trainer, fmt.out, content, self.scheduler(), groups)
        position = self.position
        present = [n for n in (SCHEDULER_FILE, USER_CONTENT_FILE) if (self.ckpt.root / n).is_file()]
        return from_nxd_tag(trainer, fmt.out, kind=position.kind, step=position.step, consumed=position.consumed,
                            scheduler=position.scheduler, where=f"{self.ckpt.root}: {position.scheduler_from}",
                            user=position.user, present=present)

    def read_back_all(self, shards: list[OutFile], new: ParallelLayout) -> None:
        """A part planned its own shards only; the read-back after the last part (``check_written``) covers every
        target shard's files, whose index names follow from the shards and the rule alone."""
        fmt = self.nxd_format
        if self.written is not None and fmt is not None:
            names = {f.shard_id: index_order(in_live_order(f, fmt, new), fmt.rule) for f in shards}
            self.written = replace(self.written, names=names)

    @staticmethod
    def sinks(model_sinks: Any, *, split: bool = False) -> Any:
        """Optimizer files are plain torch zips whatever the shards' flavour; in NxD's format with ``split``
        (xser-split shards) xser-split, as NxD's xser save writes them."""
        def make(out_file: OutFile, tmp: Path) -> Any:
            if out_file.path.startswith(OPTIM_DIR + "/"):
                if split and out_file.format == NESTED_TORCH:
                    return XserSplitSink(out_file, tmp)
                return TorchZipSink(out_file, tmp)
            return model_sinks(out_file, tmp)

        return make
