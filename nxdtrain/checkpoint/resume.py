"""The rules for resuming from a PATH, and what a tag says of where its run stands.

Resume rules (``--resume PATH``): a directory with ``model/`` but no ``optim/`` (what ``ckptconv
to-nxd`` writes) gives weights only, step 0 and a fresh optimizer; a checkpoint root gives its
newest completed tag, full state; a tag directory gives that tag, full state; ``--weights-only``
forces the first. A missing PATH, or a tag without ``done``, is an error. Shards (and optimizer state) of
another layout, dp size or ZeRO-1 setting are resharded on load (:mod:`nxdtrain.checkpoint.restore`). ``--resume auto`` (what a
requeued job passes every time) takes the newest completed tag in ``--checkpoint-dir`` when there is one,
else ``--init PATH`` by the same rules (:func:`resolve_start`).

A resume's layout: the flags', else the shards' (:func:`run_layout`, ckptconv's rule); what it reshards or cannot carry is said before
any step (:func:`resume_notes`).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptconv.core import (
    EMBED,
    LM_HEAD,
    MODEL_DIR,
    Attention,
    LayoutOverrides,
    ModelSpec,
    ParallelLayout,
    ResolvedLayout,
    Source,
    apply_layout,
    shard_file,
    stores_lm_head,
)
from ckptconv.errors import ConversionError, IntegrityError
from ckptconv.io import (
    DONE_MARKER,
    CheckedFiles,
    Metadata,
    NxdCheckpoint,
    check_whole_file,
    completed_tags,
    is_hf_dir,
    load_shard,
    resolve_checkpoint,
)
from ckptconv.sources import open_nxd
from ckptconv.training import (
    NXD_OPTIMIZER_KEY,
    OPTIM_DIR,
    SCHEDULER_FILE,
    USER_CONTENT_FILE,
    describe_zero1,
    is_training_tag,
)
from nxdtrain.checkpoint.continuity import recorded_run
from nxdtrain.checkpoint.tags import finish_interrupted_rewrites, optim_file
from nxdtrain.config.options import AUTO, CheckpointConfig, ParallelConfig
from nxdtrain.config.preflight import check_model_config
from nxdtrain.errors import TrainError
from nxdtrain.model.stage import describe


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


def resolve_resume(path: str, *, weights_only: bool, flag: str = "--resume",
                   hf_config: str | None = None) -> ResumeSource:
    """Apply the resume rules of the module docstring to ``path`` (given as ``flag``); ``hf_config``
    (``--hf-config``): the model of a checkpoint that records none."""
    given = Path(path)
    if not given.exists():
        raise TrainError(f"{flag} {path}: no such directory")
    if is_hf_dir(given):  # the likeliest first mistake: the model as downloaded, not yet converted
        raise TrainError(f"{flag} {path}: this is a Hugging Face checkpoint (config.json and its weights, no NxD "
                         f"shards): convert it with `ckptconv to-nxd {path} OUT --tp N` first, then {flag} OUT")
    tags = completed_tags(given) if given.is_dir() and (given / MODEL_DIR).is_dir() else []
    if tags:
        # Shards and tags in one directory (an older nxdtrain let --checkpoint-dir be the converted input):
        # the tags are the run's progress, the shards where it started.
        source = resolve_resume(str(tags[-1]), weights_only=weights_only, flag=flag, hf_config=hf_config)
        return dataclasses.replace(source, given=path, case=f"{source.case} (the newest completed tag in {path}; "
                                                            "its converted shards are where the run began)")
    try:
        root, _, _ = resolve_checkpoint(given)
        check_model_config(root, hf_config)
        opened = open_nxd(root, config=hf_config)  # checks sizes, headers and rank names
        opened.ckpt.close()
        ckpt, spec, layout, with_inv_freq = opened.ckpt, opened.spec, opened.layout, opened.with_inv_freq
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
        return resolve_resume(ckpt.resume or "", weights_only=ckpt.weights_only, hf_config=ckpt.hf_config)
    root = Path(ckpt.checkpoint_dir or "")
    finished = finish_interrupted_rewrites(root) if root.is_dir() else []
    if root.is_dir() and completed_tags(root):
        source = resolve_resume(str(root), weights_only=ckpt.weights_only)  # its tags record their config
        return dataclasses.replace(source, case="; ".join(["auto: " + source.case, *finished]))
    if not ckpt.init:
        raise TrainError(f"--resume auto: {root} holds no completed tag yet, and no --init PATH says where to "
                         "start (a converted NxD directory)")
    source = resolve_resume(ckpt.init, weights_only=ckpt.weights_only, flag="--init", hf_config=ckpt.hf_config)
    return dataclasses.replace(source, case=f"auto: no completed tag in {root} yet; {source.case}")


def damaged(exc: ConversionError) -> str:
    """The error of a checkpoint file that fails its checks, with what to do here (nxdtrain has no --no-check)."""
    if isinstance(exc, IntegrityError):
        return f"{exc.problem}; resume from another tag"
    return str(exc)


def run_layout(cfg: ParallelConfig, shards: ParallelLayout, spec: ModelSpec) -> ResolvedLayout:
    """The run's layout: the flags laid over the shards' by ckptconv's rule for a training run
    (:func:`ckptconv.core.layout_flags.apply_layout` with ``training=True``): what is not given is the shards'
    (tp, pp, ep, attention, fusion; the kv multiplier while tp and attention stay, else what tp needs)."""
    return apply_layout(shards, run_flags(cfg, shards), kv_heads=spec.kv_heads, training=True)


def run_flags(cfg: ParallelConfig, shards: ParallelLayout) -> LayoutOverrides:
    """nxdtrain's layout flags as ckptconv's overrides; ``--no-qkv-linear`` means separate q/k/v only where the
    shards are on qkv_linear (coalesced shards stay coalesced)."""
    attention = None
    if cfg.qkv_linear:
        attention = Attention.QKV_LINEAR
    elif cfg.qkv_linear is False and shards.attention is Attention.QKV_LINEAR:
        attention = Attention.SEPARATE
    return LayoutOverrides(tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, kvm=cfg.kv_replicator, attention=attention,
                           fuse_qkv=cfg.fuse_qkv)


LAYOUT_FIELDS = ("tp", "pp", "vpp", "kvm", "attention", "fuse_qkv", "ep")


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


# --------------------------------------------------------------------------------------------
# Reading a tag's training state


def load_side_file(path: Path, checks: CheckedFiles | None = None) -> Any:
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
    return training_state_of(load_side_file(tag / USER_CONTENT_FILE, checks), load_side_file(tag / SCHEDULER_FILE, checks),
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
