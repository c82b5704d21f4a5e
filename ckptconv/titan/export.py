"""A training tag's state for ``to-dcp``: every tag ckptconv reads (nxdtrain's, NxD's examples', NxDT's), opened
through the same :class:`~ckptconv.training.tag_reshard.TrainingTag` reshard uses, as TorchTitan's DCP entries.

nxdtrain's tag is read with its own optimizer files; NxD's and NxDT's (ZeRO-1 with or without masters, xser, DCP
optimizer) with :meth:`TrainingTag.open_nxd`, which maps their optimizer and side files into nxdtrain's terms, so
the AdamW moments TorchTitan gets are the ones ``reshard`` would write. A schedule the tag does not record (NxDT's
``LinearAnnealingWithWarmUp`` saves only its peak lr) comes from :class:`~ckptconv.titan.state.ScheduleFlags`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.layout import ParallelLayout
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import OutTensor, ReplicaGroup
from ckptconv.errors import ConversionError
from ckptconv.io.nxd_read import NxdCheckpoint
from ckptconv.sources.masters import nxdtrain_optimizer
from ckptconv.titan.config_file import TitanRun
from ckptconv.titan.plans import Tiles, plan_titan_optimizer
from ckptconv.titan.state import ScheduleFlags, titan_values
from ckptconv.training.nxdtrain_format.state import OPTIM_DIR, is_training_tag, state_replicas
from ckptconv.training.tag_reshard import TrainingTag


def open_training(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout, *, io: str) -> TrainingTag | None:
    """The tag's training state (nxdtrain's, or NxD's/NxDT's own ``optim/``), or None where there is none."""
    if is_training_tag(ckpt.root):
        return TrainingTag.open(ckpt, spec, layout, dp=None, zero1=None, io=io,
                                optim=nxdtrain_optimizer(ckpt))
    if (ckpt.root / OPTIM_DIR).is_dir():
        return TrainingTag.open_nxd(ckpt, dp=None, zero1=None, io=io)
    return None


@dataclass
class TitanState:
    """What a training tag adds to a DCP: the AdamW tensors, their replica checks, the small values, the notes,
    and the run ``torchtitan_config.py`` continues."""

    tensors: list[OutTensor] = field(default_factory=list)
    replicas: list[ReplicaGroup] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    run: TitanRun | None = None


def _saved_lr(training: TrainingTag) -> float | None:
    """The lr NxD's (NxDT's) scheduler set for the next step (``_last_lr``), to check the schedule against."""
    saved = (training.position.scheduler or {}) if training.position is not None else {}
    last = saved.get("_last_lr")
    return float(last[0]) if isinstance(last, (list, tuple)) and last else None


def titan_state(spec: ModelSpec, tiles: Tiles, replicas: list[ReplicaGroup], training: TrainingTag,
                flags: ScheduleFlags, where: str) -> TitanState:
    """The AdamW tensors of every trained parameter read through the weights' plan, and TorchTitan's values."""
    tensors = plan_titan_optimizer(spec, tiles, training.optim)
    values, notes, run = titan_values(spec, training.optim.hyper.param_groups, training.scheduler(),
                                      training.user_content, where, flags=flags, saved_lr=_saved_lr(training))
    kind = ("nxdtrain's" if training.position is None else
            "NxDT's" if training.position.kind == "NxDT" else "NxD's")
    head = (f"{kind} training tag at step {training.user_content['step']}: AdamW state "
            f"({', '.join(c for c in training.optim.hyper.components if c != 'master') or 'none'}), lr schedule and "
            "step carried (torchtitan_config.py loads them: initial_load_model_only=False)")
    schedule_notes = list(training.position.notes) if training.position is not None else []
    return TitanState(tensors, state_replicas(replicas, training.optim), values, [head, *notes, *schedule_notes], run)


def refuse_flags_without_state(flags: ScheduleFlags, src: str, weights_only: bool) -> None:
    """Schedule flags describe a training tag's schedule; with no state carried they would say nothing."""
    given = flags.given()
    if given:
        why = "--weights-only writes no optimizer state" if weights_only else f"{src} holds no optimizer state"
        names = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ConversionError(f"{names}: the schedule of a training tag's state; {why}")
