"""Training checkpoints in NxD's tag layout, and the rules for resuming from a PATH.

A tag ``<checkpoint_dir>/step_<N>/`` holds::

    model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt   one shard per (tp, pp), written by ckptconv.io.nxd.save_shard
    optim/dp_rank_DD_tp_rank_XX_pp_rank_YY.pt   optimizer state (+ fp32 masters with bf16); DD > 0 only with ZeRO-1
    scheduler.pt, user_content.pt               step, consumed samples, RNG states, the run's options
    hf/                                         config.json and tokenizer files carried from the source
    ckptconv.json                               layout, flavour, dtype, size + digest of every file
    checkpoint, done                            markers, written last (ckptconv.io.nxd.write_markers)

Resume rules (``--resume PATH``): a directory with ``model/`` but no ``optim/`` (what ``ckptconv
to-nxd`` writes) gives weights only, step 0 and a fresh optimizer; a checkpoint root gives its
newest completed tag, full state; a tag directory gives that tag, full state; ``--weights-only``
forces the first. A missing PATH, or a tag without ``done``, is an error.
"""

from __future__ import annotations

import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptconv.api import HF_FILES_DIR, open_nxd
from ckptconv.digest import DEFAULT as DEFAULT_HASH
from ckptconv.digest import record_files
from ckptconv.errors import ConversionError
from ckptconv.io.nxd import (
    DONE_MARKER,
    Flavour,
    completed_tags,
    resolve_checkpoint,
    save_shard,
    tag_step,
    write_markers,
)
from ckptconv.layout import MODEL_DIR, Attention, ParallelLayout, shard_file, shard_name
from ckptconv.metadata import Metadata, write_metadata
from ckptconv.model_spec import ModelSpec
from nxdtrain.config import ParallelConfig
from nxdtrain.device import to_host
from nxdtrain.errors import TrainError
from nxdtrain.model import describe

OPTIM_DIR = "optim"
SCHEDULER_FILE, USER_CONTENT_FILE = "scheduler.pt", "user_content.pt"


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

    def shard(self, tp_rank: int, pp_rank: int) -> Path:
        return self.files[shard_file(tp_rank=tp_rank, pp_rank=pp_rank)]


def resolve_resume(path: str, *, weights_only: bool) -> ResumeSource:
    """Apply the resume rules of the module docstring to ``path``."""
    given = Path(path)
    if not given.exists():
        raise TrainError(f"--resume {path}: no such directory")
    try:
        root, _, _ = resolve_checkpoint(given)
        ckpt, spec, layout, with_inv_freq, _ = open_nxd(root)
        ckpt.close()
    except ConversionError as exc:
        raise TrainError(f"--resume {path}: {exc}") from None
    has_optim = (root / OPTIM_DIR).is_dir()
    if has_optim and not (root / DONE_MARKER).is_file():
        raise TrainError(f"--resume {path}: {root} has {OPTIM_DIR}/ but no '{DONE_MARKER}' marker (an interrupted "
                         "save); resume from the checkpoint root to take the newest completed tag")
    if weights_only or not has_optim:
        why = "--weights-only" if weights_only and has_optim else "no optimizer state (a converted checkpoint)"
        return ResumeSource(path, root, ckpt.files, False, spec, layout, with_inv_freq,
                            f"weights only from {root} ({why}): step 0, fresh optimizer")
    where = f"tag {root}" if root == given else f"newest completed tag {root.name} of {given}"
    return ResumeSource(path, root, ckpt.files, True, spec, layout, with_inv_freq, f"full state from {where}")


def run_layout(cfg: ParallelConfig, shards: ParallelLayout) -> ParallelLayout:
    """The run's layout: tp/pp from the flags; attention, fusion and kvm from the flags or else the shards."""
    if cfg.qkv_linear is None:
        attention = shards.attention
    elif cfg.qkv_linear:
        attention = Attention.QKV_LINEAR
    else:
        attention = shards.attention if shards.attention is not Attention.QKV_LINEAR else Attention.SEPARATE
    return ParallelLayout(
        tp=cfg.tp, pp=cfg.pp, vpp=1,
        kvm=shards.kvm if cfg.kv_replicator is None else cfg.kv_replicator,
        attention=attention,
        fuse_qkv=(shards.fuse_qkv and attention is Attention.QKV_LINEAR) if cfg.fuse_qkv is None else cfg.fuse_qkv,
        hw=shards.hw, trn2_kv_layout=shards.trn2_kv_layout,
    )


def check_layout(source: ResumeSource, run: ParallelLayout) -> None:
    """Fail with the reshard command when the shards were cut for another layout."""
    fields = ("tp", "pp", "vpp", "kvm", "attention", "fuse_qkv")
    if all(getattr(source.layout, f) == getattr(run, f) for f in fields):
        return
    flags = f"--tp {run.tp} --pp {run.pp}"
    if run.attention is Attention.QKV_LINEAR:
        flags += f" --qkv-linear --kv-size-multiplier {run.kvm}" + (" --fuse-qkv" if run.fuse_qkv else " --no-fuse-qkv")
    else:
        flags += " --coalesce-qkv" if run.attention is Attention.COALESCED else " --no-qkv-linear"
    target = f"{source.root}-tp{run.tp}-pp{run.pp}"
    raise TrainError(f"--resume {source.given}: shards are {describe(source.layout)}, this run is {describe(run)}; "
                     f"reshard first: ckptconv reshard {source.root} {target} {flags} (then --resume {target})")


def check_checkpoint_dir(directory: str | None, start_step: int) -> None:
    """Refuse a ``--checkpoint-dir`` that already holds completed tags past this run's first step.

    Resuming that directory later would pick the other run's newer tag and silently drop this one's.
    """
    if not directory or not Path(directory).is_dir():
        return
    newer = [t.name for t in completed_tags(Path(directory)) if (tag_step(t.name) or 0) > start_step]
    if newer:
        raise TrainError(f"--checkpoint-dir {directory}: holds {newer[-1]}, past this run's start (step {start_step}); "
                         f"use an empty directory, or --resume {directory} to continue that run")


# --------------------------------------------------------------------------------------------
# Reading a tag's training state


def load_small(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of a tag's side file, with the error a user can act on."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TrainError(f"{path}: missing; resume from another tag or with --weights-only") from None
    except (pickle.UnpicklingError, RuntimeError) as exc:
        raise TrainError(f"{path}: not nxdtrain training state ({str(exc).splitlines()[0]}); "
                         "resume with --weights-only") from None


def optim_file(tag: Path, *, tp_rank: int, pp_rank: int, dp_rank: int) -> Path:
    return tag / OPTIM_DIR / shard_name(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)


@dataclass(frozen=True)
class TrainingState:
    step: int
    consumed_samples: int
    rng: list[dict[str, torch.Tensor]]


def read_training_state(tag: Path) -> TrainingState:
    user = load_small(tag / USER_CONTENT_FILE)
    scheduler = load_small(tag / SCHEDULER_FILE)
    step = int(user["step"])
    if int(scheduler.get("step", step)) != step:
        raise TrainError(f"{tag}: {SCHEDULER_FILE} is at step {scheduler['step']}, {USER_CONTENT_FILE} at {step}")
    return TrainingState(step, int(user["consumed_samples"]), list(user.get("rng", [])))


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
    partial = path.with_name(f".{path.name}.partial")
    torch.save(obj, partial)
    os.replace(partial, path)
    return path


def _file_records(paths: list[Path], tag: Path) -> dict[str, dict[str, Any]]:
    return {rel: rec.to_json() for rel, rec in record_files(paths, tag, DEFAULT_HASH).items()}


@dataclass
class TagWriter:
    """Writes ``step_<N>`` tags for one rank; every rank calls :meth:`save` (it is collective)."""

    root: Path
    source: ResumeSource
    layout: ParallelLayout
    coords: Any                  # dist.Coords of this rank
    zero1: bool
    flavour: Flavour
    keep: int
    options: dict[str, Any]
    host_group: Any = None       # barriers and object gathers (a gloo group when training on xla)

    def save(self, *, step: int, consumed: int, model: Any, optimizer: Any, scheduler: dict[str, Any]) -> Path:
        tag = self.root / f"step_{step}"
        rank = dist.get_rank()
        if rank == 0:
            if tag.exists():  # an interrupted save of this same step, or a rerun: start it over
                shutil.rmtree(tag)
            (tag / MODEL_DIR).mkdir(parents=True)
            (tag / OPTIM_DIR).mkdir()
        dist.barrier(group=self.host_group)
        tp, dp, pp = self.coords
        written: list[Path] = []
        if dp == 0:
            tensors, column_major = _shard_to_save(model)
            written += save_shard(tag / shard_file(tp_rank=tp, pp_rank=pp), tensors, self.flavour,
                                  column_major=column_major)
        if dp == 0 or self.zero1:
            path = optim_file(tag, tp_rank=tp, pp_rank=pp, dp_rank=dp if self.zero1 else 0)
            written.append(_save_torch(to_host(optimizer.state_dict()), path))
        mine = (_file_records(written, tag), rng_state())
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=self.host_group)
        if rank == 0:
            self._finish(tag, step, consumed, model, scheduler, gathered)
        dist.barrier(group=self.host_group)
        return tag

    def _finish(self, tag: Path, step: int, consumed: int, model: Any, scheduler: dict[str, Any],
                gathered: list[Any]) -> None:
        """Rank 0: side files, metadata, then the markers, then retention."""
        files: dict[str, dict[str, Any]] = {}
        for records, _ in gathered:
            files.update(records)
        side: list[Path] = [
            _save_torch({**scheduler, "step": step}, tag / SCHEDULER_FILE),
            _save_torch({"step": step, "consumed_samples": consumed, "rng": [rng for _, rng in gathered],
                         "options": self.options, "layout": self.layout.to_json()}, tag / USER_CONTENT_FILE),
        ]
        hf_src = self.source.root / HF_FILES_DIR
        if hf_src.is_dir():
            shutil.copytree(hf_src, tag / HF_FILES_DIR)
            side.append(tag / HF_FILES_DIR)
        files.update(_file_records(side, tag))
        dtype = next(iter(model.state_dict().values())).dtype
        write_metadata(tag, Metadata(
            kind="nxd", hf_config=self.source.spec.config, files=files, layout=self.layout.to_json(),
            flavour=self.flavour.value, dtype=str(dtype).removeprefix("torch."),
            with_inv_freq=self.source.with_inv_freq,
            extra={"nxdtrain": {"step": step, "consumed_samples": consumed}},
        ))
        write_markers(tag)
        prune(self.root, self.keep)


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


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` completed ``step_<N>`` tags; return the deleted ones.

    ``done`` goes first, so a crash halfway through a deletion leaves a tag that is never resumed.
    """
    ours = [t for t in completed_tags(root) if t.name.startswith("step_") and tag_step(t.name) is not None]
    doomed = ours[:-keep] if len(ours) > keep else []
    for tag in doomed:
        (tag / DONE_MARKER).unlink()
        shutil.rmtree(tag)
    return doomed
