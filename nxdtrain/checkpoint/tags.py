"""Training checkpoints in NxD's tag layout, and the rules for resuming from a PATH.

A tag ``<checkpoint_dir>/step_<N>/`` holds::

    model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt   one shard per (tp, pp), written by ckptconv.io.nxd_write.save_shard
    optim/dp_rank_DD_tp_rank_XX_pp_rank_YY.pt   optimizer state by parameter name (+ fp32 masters with bf16; the
                                                format of ckptconv.training.state); DD > 0 only with ZeRO-1
    scheduler.pt, user_content.pt               step, consumed samples, RNG states, the run's options
    hf/                                         config.json and tokenizer files carried from the source
    ckptconv.json                               layout, flavour, dtype, size + digest of every file
    checkpoint, done                            markers, written last (ckptconv.io.nxd_write.write_markers)

Resume rules (``--resume PATH``): a directory with ``model/`` but no ``optim/`` (what ``ckptconv
to-nxd`` writes) gives weights only, step 0 and a fresh optimizer; a checkpoint root gives its
newest completed tag, full state; a tag directory gives that tag, full state; ``--weights-only``
forces the first. A missing PATH, or a tag without ``done``, is an error. Shards (and optimizer state) of
another layout, dp size or ZeRO-1 setting are resharded on load (:mod:`nxdtrain.checkpoint.restore`). ``--resume auto`` (what a
requeued job passes every time) takes the newest completed tag in ``--checkpoint-dir`` when there is one,
else ``--init PATH`` by the same rules (:func:`resolve_start`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptconv.core.layout import HF_FILES_DIR, MODEL_DIR, Attention, ParallelLayout, default_kvm, shard_file
from ckptconv.core.mapping import EMBED, LM_HEAD, stores_lm_head
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import Source
from ckptconv.engine import outdir
from ckptconv.errors import ConversionError, IntegrityError
from ckptconv.io.checked import CheckedFiles, check_whole_file
from ckptconv.io.digest import DEFAULT as DEFAULT_HASH
from ckptconv.io.digest import record_files
from ckptconv.io.metadata import Metadata, read_metadata, write_metadata
from ckptconv.io.nxd import CHECKPOINT_MARKER, DONE_MARKER, Flavour, completed_tags, resolve_checkpoint, tag_step
from ckptconv.io.nxd_read import NxdCheckpoint, load_shard
from ckptconv.io.nxd_write import save_shard, write_markers
from ckptconv.sources.nxd import open_nxd
from ckptconv.training.nxd_optimizer_write import NXD_OPTIMIZER_KEY
from ckptconv.training.state import (
    OPTIM_DIR,
    SCHEDULER_FILE,
    USER_CONTENT_FILE,
    describe_zero1,
    is_training_tag,
    optimizer_file,
)
from nxdtrain.checkpoint.continuity import recorded_run
from nxdtrain.config import AUTO, CheckpointConfig, ParallelConfig
from nxdtrain.device import to_host
from nxdtrain.errors import TrainError
from nxdtrain.model import describe
from nxdtrain.preflight import check_model_config, check_writable

MARKERS = (DONE_MARKER, CHECKPOINT_MARKER)  # not listed in ckptconv.json, ours by name; done goes first
# The hidden siblings of a tag while --optimizer-format nxd rewrites it: the rewrite, then the replaced tag.
NXD_REWRITE_SUFFIX = ".nxd-format"
REPLACED_SUFFIX = ".format2"


@dataclass(frozen=True)
class ResumeSource:
    """What ``--resume PATH`` resolved to."""

    given: str
    root: Path                 # the directory holding model/ (a converted dir or a tag)
    files: dict[str, Path]     # canonical shard name (model/dp_rank_00_...) -> the file, whatever its legacy name
    full: bool                 # restore optimizer, step and data position too
    spec: ModelSpec
    layout: ParallelLayout
    with_inv_freq: bool
    case: str                  # one line for the log
    records: dict[str, Any] | None = None  # ckptconv.json's size + digest per file; None: no metadata
    flag: str = "--resume"     # the option that named it (--init: where --resume auto starts)
    nxd: bool = False          # optim/ written by NxD's own code (nxdtrain.checkpoint.nxd_resume), not by nxdtrain

    def shard(self, tp_rank: int, pp_rank: int) -> Path:
        return self.files[shard_file(tp_rank=tp_rank, pp_rank=pp_rank)]

    def checks(self) -> CheckedFiles:
        """Checked reads of this checkpoint: recorded sizes and digests, zip CRC-32s."""
        return CheckedFiles(self.root, self.records)

    def load_state(self, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
        """The shard of (tp_rank, pp_rank), checked as it is read (recorded digest, zip CRC-32s),
        with ``lm_head.weight`` wherever the stage has an lm_head.

        A tied model's shards written by the official converter hold no ``lm_head.weight``; the
        output projection is then the embedding: this tp rank's vocabulary rows, read from the pp
        rank 0 shard of the same tp rank (with pp > 1 the last stage's own file has no copy).
        Checkpoints of the run then carry our copy (see :func:`ckptconv.core.mapping.stores_lm_head`).
        """
        try:
            state = load_shard(self.shard(tp_rank, pp_rank), checks=self.checks())
        except ConversionError as exc:
            raise TrainError(f"{self.flag} {self.given}: {damaged(exc)}") from None
        if pp_rank == self.layout.pp - 1 and not stores_lm_head(self.spec, state):
            state[LM_HEAD] = state[EMBED] if pp_rank == 0 else self._embedding(tp_rank)
        return state

    def _embedding(self, tp_rank: int) -> torch.Tensor:
        """This tp rank's embedding rows from its first-stage shard (that tensor only, not the whole file)."""
        with NxdCheckpoint(self.root, io="read") as ckpt:
            source = Source(shard_file(tp_rank=tp_rank, pp_rank=0), EMBED)
            _, shape, _ = ckpt.info(source)
            return ckpt.read_rows(source, 0, shape[0])


def resolve_resume(path: str, *, weights_only: bool, flag: str = "--resume") -> ResumeSource:
    """Apply the resume rules of the module docstring to ``path`` (given as ``flag``)."""
    given = Path(path)
    if not given.exists():
        raise TrainError(f"{flag} {path}: no such directory")
    tags = completed_tags(given) if given.is_dir() and (given / MODEL_DIR).is_dir() else []
    if tags:
        # Shards and tags in one directory (an older nxdtrain let --checkpoint-dir be the converted input):
        # the tags are the run's progress, the shards where it started.
        source = resolve_resume(str(tags[-1]), weights_only=weights_only, flag=flag)
        return dataclasses.replace(source, given=path, case=f"{source.case} (the newest completed tag in {path}; "
                                                            "its converted shards are where the run began)")
    try:
        root, _, _ = resolve_checkpoint(given)
        check_model_config(root)
        ckpt, spec, layout, with_inv_freq, _ = open_nxd(root)  # checks sizes, headers and rank names
        ckpt.close()
        records = None if ckpt.metadata is None else ckpt.metadata.files
    except ConversionError as exc:
        raise TrainError(f"{flag} {path}: {damaged(exc)}") from None
    has_optim = (root / OPTIM_DIR).is_dir()
    if has_optim and not (root / DONE_MARKER).is_file():
        raise TrainError(f"{flag} {path}: {root} has {OPTIM_DIR}/ but no '{DONE_MARKER}' marker (an interrupted "
                         "save); resume from the checkpoint root to take the newest completed tag")
    nxd = has_optim and not is_training_tag(root)
    if weights_only or not has_optim:
        why = "--weights-only" if weights_only and has_optim else "no optimizer state (a converted checkpoint)"
        return ResumeSource(path, root, ckpt.files, False, spec, layout, with_inv_freq,
                            f"weights only from {root} ({why}): step 0, fresh optimizer", records, flag, nxd)
    where = f"tag {root}" if root == given else f"newest completed tag {root.name} of {given}"
    return ResumeSource(path, root, ckpt.files, True, spec, layout, with_inv_freq,
                        f"full state from {where}" + (_nxd_origin(ckpt.metadata) if nxd else ""), records, flag, nxd)


def _nxd_origin(meta: Metadata | None) -> str:
    """Who wrote a tag whose optim/ is in NxD's format: ckptconv records the NxD-format write in its
    ckptconv.json (``--optimizer-format nxd``); NxD's own code writes no ckptconv.json."""
    if meta is not None and isinstance((meta.extra or {}).get(NXD_OPTIMIZER_KEY), dict):
        return ", in NxD's optimizer format written by ckptconv/nxdtrain (--optimizer-format nxd)"
    return ", written by NxD's own code"


def resolve_start(ckpt: CheckpointConfig) -> ResumeSource:
    """Where the run starts: ``--resume PATH``, or ``--resume auto``: the newest completed tag in
    ``--checkpoint-dir`` when it holds one (the tag choice of :func:`resolve_resume`), else ``--init``."""
    if ckpt.resume != AUTO:
        return resolve_resume(ckpt.resume or "", weights_only=ckpt.weights_only)
    root = Path(ckpt.checkpoint_dir or "")
    finished = finish_interrupted_rewrites(root) if root.is_dir() else []
    if root.is_dir() and completed_tags(root):
        source = resolve_resume(str(root), weights_only=ckpt.weights_only)
        return dataclasses.replace(source, case="; ".join(["auto: " + source.case, *finished]))
    if not ckpt.init:
        raise TrainError(f"--resume auto: {root} holds no completed tag yet, and no --init PATH says where to "
                         "start (a converted NxD directory)")
    source = resolve_resume(ckpt.init, weights_only=ckpt.weights_only, flag="--init")
    return dataclasses.replace(source, case=f"auto: no completed tag in {root} yet; {source.case}")


def finish_interrupted_rewrites(root: Path) -> list[str]:
    """Complete the swap of an NxD-format rewrite (``--optimizer-format nxd``) that a stop interrupted.

    The rewrite replaces ``step_N`` by two renames (``step_N`` -> ``.step_N.format2``, then the complete
    ``.step_N.nxd-format`` -> ``step_N``); a stop between them leaves no ``step_N``, and ``--resume auto`` would
    silently go back to an older tag. Only a rewrite nxdtrain wrote (its run id in ckptconv.json) and that is
    complete (``done``) is put in place; then what is left of the replaced tag goes. Returns what was done."""
    said = []
    for staging in sorted(root.glob(f".step_*{NXD_REWRITE_SUFFIX}")):
        name = staging.name[1:-len(NXD_REWRITE_SUFFIX)]
        tag, replaced = root / name, root / f".{name}{REPLACED_SUFFIX}"
        if tag.exists() or not (staging / DONE_MARKER).is_file() or run_of(staging) is None:
            continue
        os.rename(staging, tag)
        said.append(f"{tag}: put in place its complete NxD-format rewrite {staging.name} (a stop came between the "
                    "two renames that replace a tag)")
        if replaced.is_dir() and run_of(replaced) == run_of(tag):
            remove_tag(replaced)
    return said


def damaged(exc: ConversionError) -> str:
    """The error of a checkpoint file that fails its checks, with what to do here (nxdtrain has no --no-check)."""
    if isinstance(exc, IntegrityError):
        return f"{exc.problem}; resume from another tag"
    return str(exc)


def run_layout(cfg: ParallelConfig, shards: ParallelLayout, spec: ModelSpec) -> ParallelLayout:
    """The run's layout: tp/pp from the flags; attention, fusion and kvm from the flags or else the shards
    (kvm: the shards' at their tp, else what the run's tp needs: tp / kv heads when tp > kv heads)."""
    if cfg.qkv_linear is None:
        attention = shards.attention
    elif cfg.qkv_linear:
        attention = Attention.QKV_LINEAR
    else:
        attention = shards.attention if shards.attention is not Attention.QKV_LINEAR else Attention.SEPARATE
    kvm = cfg.kv_replicator
    if kvm is None:
        kvm = shards.kvm if cfg.tp == shards.tp and attention is shards.attention else default_kvm(
            cfg.tp, spec.kv_heads, attention)
    return ParallelLayout(
        tp=cfg.tp, pp=cfg.pp, vpp=1, kvm=kvm, attention=attention,
        fuse_qkv=(shards.fuse_qkv and attention is Attention.QKV_LINEAR) if cfg.fuse_qkv is None else cfg.fuse_qkv,
        hw=shards.hw, trn2_kv_layout=shards.trn2_kv_layout,
        padded_vocab=shards.padded_vocab if cfg.tp == shards.tp else None,  # else: reshard (check_layout says so)
    )


LAYOUT_FIELDS = ("tp", "pp", "vpp", "kvm", "attention", "fuse_qkv")


def same_layout(shards: ParallelLayout, run: ParallelLayout) -> bool:
    """Whether the shards are this run's own (else each rank reads its shard through the reshard plan)."""
    return all(getattr(shards, f) == getattr(run, f) for f in LAYOUT_FIELDS)


def resume_notes(source: ResumeSource, run: ParallelLayout, state: TrainingState | None, *, zero1: bool, dp: int,
                 world: int, optimizer: str) -> list[str]:
    """What a resume reshards on load, and what it cannot carry exactly: one line each, printed before any step."""
    notes = []
    weights = not same_layout(source.layout, run)
    saved = (bool(state.options.get("zero1")), saved_dp(source)) if state is not None else None
    optim = saved is not None and saved != (zero1, dp if zero1 else 1)
    if weights or optim:
        what = "weights" + (" and optimizer state" if state is not None else "")
        old = describe(source.layout) + ("" if saved is None else f", {describe_zero1(*saved)}")
        new = describe(run) + ("" if state is None else f", {describe_zero1(zero1, dp)}")
        notes.append(f"resharding on load ({what}, each rank reads its slices of the tag): {old} -> {new}")
    saved_optimizer = state.options.get("optimizer") if state is not None else None
    if saved_optimizer is not None and saved_optimizer != optimizer:
        notes.append(f"not carried: the tag's {saved_optimizer} state (this run is --optimizer {optimizer}; it starts "
                     "its own state at the tag's weights and step)")
    if state is not None and len(state.rng) != world:
        saved_by = f"saved by a world of {len(state.rng)}" if state.rng else "not in the tag"
        notes.append(f"not carried exactly: RNG states ({saved_by}, this run has {world} ranks; "
                     "training draws no random numbers, so the steps are unchanged); the data continues at sample "
                     f"{state.consumed_samples}: a global batch is the same rows whatever dp is, each dp rank takes "
                     "its share")
    return notes


def saved_dp(source: ResumeSource) -> int:
    """How many dp ranks' optimizer files the tag holds (1 without ZeRO-1)."""
    count = 0
    while optim_file(source.root, tp_rank=0, pp_rank=0, dp_rank=count).is_file():
        count += 1
    return max(count, 1)


def check_checkpoint_dir(directory: str | None, start_step: int) -> None:
    """Refuse a ``--checkpoint-dir`` this user cannot write, or that holds completed tags past this run's first step.

    Resuming that directory later would pick the other run's newer tag and silently drop this one's.
    """
    if not directory:
        return
    check_writable(directory, "--checkpoint-dir")
    if not Path(directory).is_dir():
        return
    if (Path(directory) / MODEL_DIR).is_dir():
        raise TrainError(f"--checkpoint-dir {directory}: holds NxD shards ({MODEL_DIR}/: a converted checkpoint or a "
                         f"tag); tags written there would sit behind those shards, and a requeued --resume {directory} "
                         f"would start again from them at step 0: use a directory of its own, e.g. "
                         f"{str(directory).rstrip('/')}-run")
    newer = [t.name for t in completed_tags(Path(directory)) if (tag_step(t.name) or 0) > start_step]
    if newer:
        raise TrainError(f"--checkpoint-dir {directory}: holds {newer[-1]}, past this run's start (step {start_step}); "
                         f"use an empty directory, or --resume {directory} to continue that run")


# --------------------------------------------------------------------------------------------
# Reading a tag's training state


def load_small(path: Path, checks: CheckedFiles | None = None) -> Any:
    """``torch.load(weights_only=True)`` of a tag's side file, with the error a user can act on;
    with ``checks``, of its bytes checked against the tag's ckptconv.json."""
    try:
        data = check_whole_file(path, checks.record(path) if checks is not None else None)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TrainError(f"{path}: missing; resume from another tag or with --weights-only") from None
    except ConversionError as exc:
        raise TrainError(f"--resume: {damaged(exc)}") from None
    except (pickle.UnpicklingError, RuntimeError) as exc:
        raise TrainError(f"{path}: not nxdtrain training state ({str(exc).splitlines()[0]}); "
                         "resume with --weights-only") from None


def optim_file(tag: Path, *, tp_rank: int, pp_rank: int, dp_rank: int) -> Path:
    return tag / optimizer_file(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)


@dataclass(frozen=True)
class TrainingState:
    step: int
    consumed_samples: int
    rng: list[dict[str, torch.Tensor]]
    options: dict[str, Any]  # the saving run's flat options (TrainConfig.to_flat)
    run: dict[str, Any] = dataclasses.field(default_factory=dict)  # schedule and data order (nxdtrain.checkpoint.continuity)
    missing: list[str] = dataclasses.field(default_factory=list)   # what an older tag's record lacks
    loss: float | None = None  # the loss logged at the tag's step (nxdtrain.checkpoint.loss_check); None: not recorded
    notes: list[str] = dataclasses.field(default_factory=list)     # how the position was read, where not recorded


def read_training_state(tag: Path, checks: CheckedFiles | None = None, *, gbs: int | None = None) -> TrainingState:
    """The tag's position; a tag without ``consumed_samples`` (``ckptconv reshard`` of NxD's tag, which records
    none) continues at step x ``gbs``, as a resume of NxD's tag itself does, and says so."""
    return training_state_of(load_small(tag / USER_CONTENT_FILE, checks), load_small(tag / SCHEDULER_FILE, checks),
                             tag, gbs=gbs)


def training_state_of(user: dict[str, Any], scheduler: dict[str, Any], tag: Path, *, gbs: int | None) -> TrainingState:
    """The position nxdtrain's ``user_content``/``scheduler`` records say (:func:`read_training_state`; a tag in
    NxD's format keeps them under ``user_content.pt['nxdtrain']``)."""
    step = int(user["step"])
    if int(scheduler.get("step", step)) != step:
        raise TrainError(f"{tag}: {SCHEDULER_FILE} is at step {scheduler['step']}, {USER_CONTENT_FILE} at {step}")
    run, missing = recorded_run(user, scheduler)
    loss = user.get("loss")
    notes = []
    if user.get("consumed_samples") is None:
        if gbs is None:
            raise TrainError(f"{tag / USER_CONTENT_FILE}: no consumed_samples recorded")
        consumed = step * gbs
        notes.append(f"the data continues at sample {consumed} = step {step} x --gbs {gbs} (the tag records no "
                     "consumed samples: resharded from NxD's own tag)")
    else:
        consumed = int(user["consumed_samples"])
    return TrainingState(step, consumed, list(user.get("rng", [])), dict(user.get("options", {})),
                         run, missing, float(loss) if isinstance(loss, (int, float)) else None, notes)


# --------------------------------------------------------------------------------------------
# Writing a tag


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _save_torch(obj: Any, path: Path) -> Path:
    """torch.save to a temporary name in the same directory, then rename: never a half-written file."""
    with outdir.atomic_target(path) as partial:
        torch.save(obj, partial)
    return path


def _file_records(paths: list[Path], tag: Path) -> dict[str, dict[str, Any]]:
    return {rel: rec.to_json() for rel, rec in record_files(paths, tag, DEFAULT_HASH).items()}


# Bands of each rank's share of a rewrite in NxD's format: every rank of a node rewrites at once, beside the model
REWRITE_MEMORY = 256 << 20


@dataclass
class TagWriter:
    """Writes ``step_<N>`` tags for one rank; every rank calls :meth:`save` (it is collective)."""

    root: Path
    source: ResumeSource
    layout: ParallelLayout
    coords: Any                  # dist.Coords of this rank
    zero1: bool                  # with zero_rank: this rank's ZeRO-1 shard (its index in the dp x cp group)
    flavour: Flavour
    keep: int
    options: dict[str, Any]
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # the run record (nxdtrain.checkpoint.continuity)
    host_group: Any = None       # barriers and object gathers (a gloo group when training on xla)
    zero_rank: int = 0
    zero_size: int = 1           # the ranks a ZeRO-1 state is partitioned over (dp x cp)
    nxd_zero1: bool = False      # --zero1 as asked (at dp 1 there is no ZeRO-1 group, NxD's format has ZeRO-1 files)
    nxd_param_groups: str | None = None  # --optimizer-format nxd: each tag rewritten in NxD's format by this rule

    def save(self, *, step: int, consumed: int, model: Any, optimizer: Any, scheduler: dict[str, Any],
             loss: float | None = None) -> Path:
        tag = self.root / f"step_{step}"
        rank = dist.get_rank()
        lock = self._claim(tag, step) if rank == 0 else None
        dist.barrier(group=self.host_group)
        tp, pp = self.coords.tp, self.coords.pp
        # The ranks of one (tp, pp) hold the same shard: the first of its dp x cp replicas writes it, as at cp 1.
        first = self.coords.dp == 0 and self.coords.cp == 0
        written: list[Path] = []
        if first:
            tensors, column_major = _shard_to_save(model)
            written += save_shard(tag / shard_file(tp_rank=tp, pp_rank=pp), tensors, self.flavour,
                                  column_major=column_major)
        if first or self.zero1:
            path = optim_file(tag, tp_rank=tp, pp_rank=pp, dp_rank=self.zero_rank if self.zero1 else 0)
            written.append(_save_torch(to_host(optimizer.state_dict()), path))
        mine = (_file_records(written, tag), rng_state())
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=self.host_group)
        if rank == 0:
            assert lock is not None
            with lock:
                self._finish(tag, step, consumed, model, scheduler, gathered, loss)
        dist.barrier(group=self.host_group)
        if self.nxd_param_groups is not None:
            self._in_nxd_format(tag)
        return tag

    def _in_nxd_format(self, tag: Path) -> None:
        """The tag just saved rewritten in NxD's own optimizer format (``ckptconv reshard --optimizer-format nxd``
        at the same layout), every rank writing its share of the files (``--part rank/world``) into a hidden
        sibling that replaces the tag when complete: until then the saved tag stays as it is, complete."""
        from ckptconv.commands.api import RunOptions, reshard  # noqa: PLC0415 (only runs that ask for NxD's format)

        staging = tag.with_name(f".{tag.name}{NXD_REWRITE_SUFFIX}")
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0 and staging.exists():  # an interrupted rewrite of this step: what ckptconv wrote there goes
            outdir.remove_owned(staging, also=MARKERS, keep=())
        dist.barrier(group=self.host_group)
        layout = self.layout
        try:
            reshard(tag, staging, tp=layout.tp, pp=layout.pp, vpp=layout.vpp, kv_size_multiplier=layout.kvm,
                    attention=layout.attention, fuse_qkv=layout.fuse_qkv, hw_backend=layout.hw,
                    trn2_kv_layout=layout.trn2_kv_layout, dp=self.zero_size, zero1=self.nxd_zero1,
                    optimizer_format="nxd", nxd_param_groups=self.nxd_param_groups,
                    options=RunOptions(quiet=True, part=(rank, world), workers=1, max_memory=REWRITE_MEMORY))
        except ConversionError as exc:
            raise TrainError(f"{tag}: saved, but not rewritten in NxD's format (--optimizer-format nxd): {exc}") from None
        dist.barrier(group=self.host_group)
        if rank == 0:
            meta = read_metadata(staging)
            assert meta is not None
            extra = dict(meta.extra or {})
            extra["nxdtrain"] = {**extra.get("nxdtrain", {}), "run": self.record.get("run")}  # prune finds it
            write_metadata(staging, dataclasses.replace(meta, extra=extra))
            replaced = tag.with_name(f".{tag.name}{REPLACED_SUFFIX}")
            os.rename(tag, replaced)
            os.rename(staging, tag)
            remove_tag(replaced)
        dist.barrier(group=self.host_group)

    def _claim(self, tag: Path, step: int) -> outdir.OutLock:
        """Rank 0: lock the tag, clear what an earlier save of this step left (only what nxdtrain
        wrote there), declare what this save writes, before any rank writes a byte."""
        if tag.exists() and os.path.realpath(tag) == os.path.realpath(self.source.root):
            raise TrainError(f"{tag}: is the checkpoint this run resumed from; it is not saved over")
        lock = outdir.acquire(tag, fingerprint=f"nxdtrain-step-{step}")
        try:
            strangers = outdir.foreign(tag, MARKERS)
            if strangers:
                raise TrainError(f"{tag}: holds {strangers[0]!r}, which nxdtrain did not write; move it away "
                                 "or use another --checkpoint-dir")
            outdir.remove_owned(tag, also=MARKERS)  # an interrupted save of this same step, or a rerun: start it over
            outdir.declare(tag, "tag", [MODEL_DIR, OPTIM_DIR, HF_FILES_DIR, SCHEDULER_FILE, USER_CONTENT_FILE,
                                        CHECKPOINT_MARKER, DONE_MARKER])
            outdir.ensure_dir(tag, MODEL_DIR)
            outdir.ensure_dir(tag, OPTIM_DIR)
            # The 'checkpoint' marker first: until 'done' follows, every reader sees an interrupted
            # save (refused), never a directory of shards that looks complete.
            outdir.write_text(tag / CHECKPOINT_MARKER, "1")
        except BaseException:
            lock.release()
            raise
        return lock

    def _finish(self, tag: Path, step: int, consumed: int, model: Any, scheduler: dict[str, Any],
                gathered: list[Any], loss: float | None) -> None:
        """Rank 0: side files, metadata, then the markers, then retention."""
        files: dict[str, dict[str, Any]] = {}
        for records, _ in gathered:
            files.update(records)
        side: list[Path] = [
            _save_torch({**scheduler, "step": step}, tag / SCHEDULER_FILE),
            _save_torch({"step": step, "consumed_samples": consumed, "rng": [rng for _, rng in gathered],
                         "options": self.options, "layout": self.layout.to_json(), "run": self.record,
                         "loss": loss},
                        tag / USER_CONTENT_FILE),
        ]
        hf_src = self.source.root / HF_FILES_DIR
        if hf_src.is_dir() and not hf_src.is_symlink():
            names = sorted(p.name for p in hf_src.iterdir() if not p.is_dir())
            for name, real in outdir.confined_files(self.source.root, HF_FILES_DIR, names, []):
                side.append(outdir.copy_file(Path(real), outdir.ensure_dir(tag, HF_FILES_DIR) / name))
        files.update(_file_records(side, tag))
        dtype = next(iter(model.state_dict().values())).dtype
        write_metadata(tag, Metadata(
            kind="nxd", hf_config=self.source.spec.config, files=files, layout=self.layout.to_json(),
            flavour=self.flavour.value, dtype=str(dtype).removeprefix("torch."),
            with_inv_freq=self.source.with_inv_freq,
            extra={"nxdtrain": {"step": step, "consumed_samples": consumed, "run": self.record.get("run")}},
        ))
        write_markers(tag)
        outdir.clear_tmp(tag)  # complete: ckptconv.json lists the files, the markers are known names
        prune(self.root, self.keep, run=str(self.record.get("run")))


def _shard_to_save(model: Any) -> tuple[dict[str, torch.Tensor], set[str] | None]:
    """The shard's tensors and, for a device tensor (whose strides say nothing), the column-major keys.

    On a device the parameters are handed over as they are: save_shard copies each to the CPU when
    it writes it, so the host never holds the whole shard and no relayout is traced on the device.
    """
    params = model.state_dict()
    if all(t.device.type == "cpu" for t in params.values()):
        return model.shard_state(), None
    records = model.records()
    return {r.key: params[r.key].detach() for r in records}, {r.key for r in records if r.column_major}


def remove_tag(tag: Path) -> None:
    """Delete what nxdtrain wrote in ``tag`` (what its ckptconv.json lists, and the markers; ``done`` first, so a
    crash halfway leaves a tag that is never resumed), and the directory when nothing foreign is left in it."""
    outdir.remove_owned(tag, also=MARKERS, keep=())
    with contextlib.suppress(OSError):
        tag.rmdir()


def run_of(tag: Path) -> str | None:
    """The id of the run that wrote ``tag`` (ckptconv.json ``extra.nxdtrain.run``); None: unknown (an older
    nxdtrain, another tool, no readable metadata)."""
    try:
        meta = read_metadata(tag)
    except ConversionError:
        return None
    extra = (meta.extra if meta is not None else None) or {}
    run = (extra.get("nxdtrain") or {}).get("run") if isinstance(extra.get("nxdtrain"), dict) else None
    return run if isinstance(run, str) else None


def prune(root: Path, keep: int, *, run: str) -> list[Path]:
    """Delete all but the newest ``keep`` completed ``step_<N>`` tags of the run ``run``; return the deleted ones.

    Only tags that run wrote (its id in their ckptconv.json; a resume carries the id on) are counted and
    deleted: another run's tags in the same directory, and tags of unknown origin, are never touched.
    ``done`` goes first, so a crash halfway through a deletion leaves a tag that is never resumed.
    Only what nxdtrain wrote there goes (what its ckptconv.json lists, and the markers); a tag
    holding anything else keeps that, and its directory.
    """
    ours = [t for t in completed_tags(root)
            if t.name.startswith("step_") and tag_step(t.name) is not None and run_of(t) == run]
    doomed = ours[:-keep] if len(ours) > keep else []
    for tag in doomed:
        remove_tag(tag)
    return doomed


# --------------------------------------------------------------------------------------------
# One writer per checkpoint directory

RUN_LOCK = "nxdtrain-run"


def _busy(directory: str | Path, exc: outdir.BusyError) -> TrainError:
    holder = exc.holder
    since = f", started {holder['started']}" if holder.get("started") else ""
    return TrainError(f"--checkpoint-dir {directory}: another training run writes there "
                      f"({outdir.describe_holder(holder)}{since}); two runs in one directory would interleave "
                      "their tags: wait for it to end (or stop it), or use another --checkpoint-dir")


def check_one_writer(directory: str | None) -> None:
    """Refuse, before any process starts, a ``--checkpoint-dir`` that a live run holds (creates nothing)."""
    if directory and Path(directory).is_dir():
        try:
            outdir.check_free(Path(directory))
        except outdir.BusyError as exc:
            raise _busy(directory, exc) from None


def claim_checkpoint_dir(directory: str, command: str) -> outdir.OutLock:
    """Rank 0: hold ``--checkpoint-dir`` for the whole run (ckptconv's output lock: a flock the kernel drops
    when the process dies, even by SIGKILL, with an owner record naming pid, host, start and command)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    try:
        return outdir.acquire(path, fingerprint=RUN_LOCK, command=command)
    except outdir.BusyError as exc:
        raise _busy(directory, exc) from None
