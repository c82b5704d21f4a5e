"""A training tag's optimizer hyper-parameters, schedule position and step as TorchTitan's DCP values, and back.

TorchTitan (pinned: :data:`~ckptconv.titan.names.TITAN_VERSION`) saves beside its model and AdamW tensors:

* ``optimizer.param_groups.<param>.<field>`` for every trained parameter: the values of its param group (torch's
  loader refuses a group whose parameters disagree, so nxdtrain's two groups, matrices and norm weights, need two
  groups in TorchTitan's optimizer config, by FQN pattern, when their values differ);
* ``lr_scheduler.last_epoch``: how often its ``LambdaLR`` stepped; on load the lambda is recomputed from it, but
  the optimizer's ``lr`` stays the loaded value: that is the lr of the next step;
* ``train_state.step`` and ``train_state.ntokens_seen``.

TorchTitan's schedule (``linear_warmup_stable_decay``) with ``W`` warmup steps, decay over the rest and no
``decay_ratio`` runs its decay one step later than nxdtrain's (it keeps one "virtual" stable step at the peak).
``last_epoch = step + 1`` once warmup is over cancels that shift exactly: from then on the lr TorchTitan computes
is nxdtrain's at every step (see :func:`titan_last_epoch`). A tag still in warmup keeps ``last_epoch = step``:
exact through warmup, the decay one step late.

    >>> titan_last_epoch(step=5, warmup=2)
    6
    >>> titan_last_epoch(step=1, warmup=2)
    1
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptconv.core.model_spec import ModelSpec
from ckptconv.errors import ConversionError
from ckptconv.titan.config_file import TitanRun
from ckptconv.titan.names import PARAM_GROUP_FIELDS, param_group_key, trained_params
from ckptconv.training.nxdtrain_format.state import is_matrix
from ckptconv.training.schedules import Recorded, lr_at

# The fields that choose torch's implementation, not the math: TorchTitan picks its own on its device.
IMPLEMENTATION = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}
# The fields whose values are the run's AdamW (carried as the tag recorded them).
MATH_FIELDS = ("betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
OUR_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "linear"}  # nxdtrain's -> TorchTitan decay_type
# NxD's CosineAnnealing and NxDT's LinearAnnealingWithWarmUp: TorchTitan's warmup-stable-decay with warmup W, total
# steps T (its one "virtual" stable step is their peak at step W) gives their lr at every epoch from W to T
NXD_SCHEDULES = {"CosineAnnealing": "cosine", "LinearAnnealingWithWarmUp": "linear"}
SCHEDULE_KEYS = ("schedule", "lr", "min_lr", "warmup", "decay_steps")


def titan_last_epoch(*, step: int, warmup: int, shift: int = 1) -> int:
    """``lr_scheduler.last_epoch`` for a tag at ``step`` (see the module docstring: nxdtrain's schedules past
    warmup one more, ``shift``; NxD's and NxDT's none)."""
    return step + shift if step >= warmup else step


@dataclass(frozen=True)
class ScheduleFlags:
    """A schedule the tag does not record, given as nxdtrain's flags (``--schedule``, ``--lr``, ...); None: not given."""

    schedule: str | None = None
    lr: float | None = None
    min_lr: float | None = None
    warmup: int | None = None
    decay_steps: int | None = None

    def given(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SCHEDULE_KEYS if getattr(self, k) is not None}


@dataclass(frozen=True)
class TitanSchedule:
    """TorchTitan's configuration that continues a source schedule (its config field names)."""

    lr: float
    warmup_steps: int
    decay_type: str
    min_lr_factor: float
    total_steps: int
    shift: int = 1  # lr_scheduler.last_epoch = step + shift past warmup (nxdtrain's 1, NxD's/NxDT's 0)

    def describe(self) -> str:
        return (f"optimizer lr {self.lr:g}, lr_scheduler warmup_steps={self.warmup_steps}, "
                f"decay_type={self.decay_type}, min_lr_factor={self.min_lr_factor:g}, "
                f"total_steps={self.total_steps}, decay_ratio unset")


_MIN_LR_NOTE = {"min_lr": " (none for LinearAnnealingWithWarmUp, which decays to 0)"}


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def merged_schedule(record: Mapping[str, Any], flags: ScheduleFlags, where: str) -> dict[str, Any]:
    """The tag's schedule record completed by ``flags``: a flag that differs from what the tag records is refused
    naming both; what neither says is refused naming exactly what is missing."""
    merged = {k: record.get(k) for k in SCHEDULE_KEYS}
    for key, value in flags.given().items():
        known = merged[key]
        if known is not None and (float(known) != float(value) if key != "schedule" else known != value):
            raise ConversionError(f"{_flag(key)} {value}: the tag records {key} {known!r} (its state was trained with "
                                  f"it); drop {_flag(key)}, or change the schedule in torchtitan_config.py afterwards")
        merged[key] = value
    if merged["schedule"] in ("LinearAnnealingWithWarmUp", "constant") and merged["min_lr"] is None:
        merged["min_lr"] = 0.0 if merged["schedule"] != "constant" else merged["lr"]  # no minimum to give
    missing = [k for k in SCHEDULE_KEYS if merged[k] is None and not (k == "decay_steps" and merged["schedule"] == "constant")]
    if missing:
        raise ConversionError(
            f"{where}: the tag records no {', '.join(missing)} of its learning-rate schedule (NxDT's "
            "LinearAnnealingWithWarmUp, say, saves only its peak lr), and TorchTitan's scheduler must continue it: pass "
            f"{' '.join(_flag(k) + ' ' + k.upper() + _MIN_LR_NOTE.get(k, '') for k in missing)} as the run had them (nxdtrain's names; --schedule "
            f"{'|'.join([*OUR_SCHEDULES, *NXD_SCHEDULES])}), or --weights-only for the model alone")
    if merged["schedule"] not in (*OUR_SCHEDULES, *NXD_SCHEDULES):
        raise ConversionError(f"{where}: schedule {merged['schedule']!r}: TorchTitan continues "
                              f"{', '.join([*OUR_SCHEDULES, *NXD_SCHEDULES])}; pass --weights-only for the model alone")
    return merged


def titan_schedule(record: Mapping[str, Any], where: str,
                   flags: ScheduleFlags = ScheduleFlags()) -> tuple[Recorded, int, TitanSchedule]:
    """The tag's schedule (completed by ``flags``), its decay steps, and TorchTitan's equivalent."""
    merged = merged_schedule(record, flags, where)
    try:
        schedule = Recorded(str(merged["schedule"]), float(merged["lr"]), float(merged["min_lr"]),
                            float(merged["warmup"] or 0))
        decay_steps = int(merged["decay_steps"] or 0)
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"{where}: schedule record {merged}: {exc}") from None
    if schedule.warmup != int(schedule.warmup):
        raise ConversionError(f"{where}: warmup {schedule.warmup} is not a step count")
    floor = float(schedule.min_lr or 0.0) / schedule.lr if schedule.lr else 0.0
    if schedule.schedule in NXD_SCHEDULES:
        return schedule, decay_steps, TitanSchedule(schedule.lr, int(schedule.warmup), NXD_SCHEDULES[schedule.schedule],
                                                    floor, decay_steps, shift=0)
    floor = 1.0 if schedule.schedule == "constant" else floor
    return schedule, decay_steps, TitanSchedule(schedule.lr, int(schedule.warmup), OUR_SCHEDULES[schedule.schedule],
                                                floor, max(decay_steps, 1))


def check_scheduler_lr(schedule: Recorded, decay_steps: int, step: int, saved_lr: float | None, where: str) -> None:
    """The lr the source's scheduler saved for its next step is the schedule's (given flags that do not describe
    the run that wrote the tag are caught here)."""
    if saved_lr is None:
        return
    ours = lr_at(step + 1, schedule, decay_steps=decay_steps)
    if abs(ours - saved_lr) > 1e-9 * max(abs(saved_lr), 1e-12) + 1e-15:
        raise ConversionError(f"{where}: the tag's scheduler set lr {saved_lr!r} for step {step + 1}; the schedule "
                              f"{schedule.schedule} (lr {schedule.lr:g}, min_lr {schedule.min_lr:g}, warmup "
                              f"{int(schedule.warmup)}, decay steps {decay_steps}) gives {ours!r}: give the run's own "
                              "--schedule/--warmup/--decay-steps")


def titan_values(spec: ModelSpec, param_groups: list[dict[str, Any]], scheduler: Mapping[str, Any],
                 content: Mapping[str, Any], where: str, *, flags: ScheduleFlags = ScheduleFlags(),
                 saved_lr: float | None = None) -> tuple[dict[str, Any], list[str], TitanRun]:
    """TorchTitan's param-group, lr-scheduler and train-state values for a tag at ``content["step"]``, what to
    tell the user, and the run :mod:`ckptconv.titan.config_file` writes out (``saved_lr``: the lr the source's
    scheduler set for the next step, checked against the schedule)."""
    step = int(content["step"])
    schedule, decay_steps, titan = titan_schedule(scheduler, where, flags)
    check_scheduler_lr(schedule, decay_steps, step, saved_lr, where)
    groups = _groups(param_groups, schedule, decay_steps, step, where)
    values: dict[str, Any] = {}
    for param in trained_params(spec):  # nxdtrain's groups: matrices, then vectors (the norm weights)
        group = groups[0 if is_matrix(param.shape) or len(groups) == 1 else 1]
        values.update({param_group_key(param.key, f): group[f] for f in PARAM_GROUP_FIELDS})
    notes = []
    last_epoch = titan_last_epoch(step=step, warmup=titan.warmup_steps, shift=titan.shift)
    exact = last_epoch > step or (titan.shift == 0 and step >= titan.warmup_steps)
    comments = [f"{schedule.schedule} (lr {schedule.lr:g}, min_lr {schedule.min_lr:g}, warmup {int(schedule.warmup)}, "
                f"decay steps {decay_steps}) as TorchTitan's warmup-stable-decay: lr_scheduler.last_epoch "
                f"{last_epoch} in the DCP; from step {step + 1} to {decay_steps} its lr is the source's"
                + ("" if exact else " after warmup (the tag is still in warmup: TorchTitan's warmup ramp differs)")]
    if schedule.schedule in OUR_SCHEDULES or schedule.schedule == "CosineAnnealing":
        comments.append("past total_steps TorchTitan does not hold min_lr (the source does): stop at total_steps")
    notes.append(f"lr schedule: {titan.describe()}: " + comments[0])
    seq_len = content.get("options", {}).get("seq_len")
    consumed = content.get("consumed_samples", 0)  # None: resharded from NxD's tag, which records none
    values.update({"lr_scheduler.last_epoch": last_epoch, "train_state.step": step,
                   "train_state.ntokens_seen": int(consumed) * int(seq_len) if seq_len and consumed is not None else 0})
    seen = f"the source consumed {int(consumed)} samples" if consumed is not None else "the tag records no consumed samples"
    notes.append(f"not carried: the data loader position ({seen}; TorchTitan's "
                 "loader starts its data from the beginning: skip those rows, or continue on other data)")
    adamw = tuple({"lr": schedule.lr, **{f: g[f] for f in ("betas", "eps", "weight_decay")}} for g in groups)
    clip = content.get("options", {}).get("clip_grad")
    run = TitanRun((adamw[0], adamw[-1]), titan.warmup_steps, titan.decay_type, titan.min_lr_factor,
                   titan.total_steps, step, int(seq_len) if seq_len else None,
                   float(clip) if isinstance(clip, (int, float)) and clip > 0 else None, tuple(comments))
    return values, notes, run


def _groups(param_groups: list[dict[str, Any]], schedule: Recorded, decay_steps: int, step: int,
            where: str) -> list[dict[str, Any]]:
    """TorchTitan's param-group values per nxdtrain group: the lr of the next step, the peak lr, the AdamW math."""
    if not param_groups:
        raise ConversionError(f"{where}: the tag's optimizer files record no param groups")
    missing = [f for g in param_groups for f in MATH_FIELDS if f not in g]
    if missing:
        raise ConversionError(f"{where}: the tag's param group has no {missing[0]!r}; not torch AdamW state "
                              "(TorchTitan's checkpoint needs AdamW): pass --weights-only for the model alone")
    groups = [{"lr": lr_at(step + 1, schedule, decay_steps=decay_steps), "initial_lr": schedule.lr,
               **{f: g[f] for f in MATH_FIELDS}, **IMPLEMENTATION} for g in param_groups]
    assert set(groups[0]) == set(PARAM_GROUP_FIELDS), sorted(set(groups[0]) ^ set(PARAM_GROUP_FIELDS))
    return groups


# --------------------------------------------------------------------------------------------
# Back: a full TorchTitan checkpoint's state as an nxdtrain training tag's


@dataclass(frozen=True)
class TagState:
    """What an nxdtrain tag records beside its shards, from a TorchTitan checkpoint."""

    param_groups: list[dict[str, Any]]  # nxdtrain's two AdamW groups: matrices, then vectors (the norm weights)
    user_content: dict[str, Any]
    scheduler: dict[str, Any]
    notes: list[str]


def tag_state(read_value: Any, spec: ModelSpec, *, zero1: bool, consumed_samples: int | None,
              where: str) -> TagState:
    """nxdtrain's param groups, ``user_content.pt`` and ``scheduler.pt`` from TorchTitan's values (``read_value(key)``).

    nxdtrain has one AdamW group for matrices and one for vectors; a TorchTitan run whose groups split its
    parameters otherwise is refused, naming the first parameter whose values differ from its kind's."""
    groups: list[dict[str, Any]] = []
    first: list[str] = []
    for param in trained_params(spec):
        kind = 0 if is_matrix(param.shape) else 1
        values = {f: read_value(param_group_key(param.key, f)) for f in ("lr", "initial_lr", *MATH_FIELDS)}
        if kind == len(groups):
            groups.append(values)
            first.append(param.key)
        elif kind > len(groups):
            raise AssertionError("trained_params lists matrices first")
        elif values != groups[kind]:
            differ = next(f for f in values if values[f] != groups[kind][f])
            raise ConversionError(f"{where}: {param.key} has {differ} {values[differ]!r}, {first[kind]} "
                                  f"{groups[kind][differ]!r}: nxdtrain keeps one AdamW group for matrices and one for "
                                  "norm weights; this TorchTitan run groups its parameters otherwise")
    step = int(read_value("train_state.step"))
    last_epoch = int(read_value("lr_scheduler.last_epoch"))
    tokens = int(read_value("train_state.ntokens_seen"))
    notes = [f"TorchTitan checkpoint at step {step}: AdamW state and step carried (nxdtrain --resume OUT continues "
             "with them); nxdtrain computes each step's lr from its own flags: give it TorchTitan's schedule "
             f"(--lr {groups[0]['initial_lr']:g}; lr_scheduler.last_epoch {last_epoch}: "
             + ("--warmup and --decay-steps as TorchTitan's warmup_steps and total_steps, a run that came from "
                "nxdtrain" if last_epoch == step + 1 else "--warmup W+1 and --decay-steps T+1 for TorchTitan's "
                "warmup_steps W and total_steps T, exact past warmup") + ")"]
    if consumed_samples is None:
        notes.append(f"not carried: the data position (TorchTitan had seen {tokens} tokens); nxdtrain starts its "
                     "data at sample 0: pass --consumed-samples N to continue at row N")
    nxd_groups = [{f: g[f] for f in ("lr", *MATH_FIELDS)} | IMPLEMENTATION for g in groups]
    content = {"step": step, "consumed_samples": consumed_samples or 0, "rng": [],
               "options": {"optimizer": "adamw", "zero1": zero1}}
    scheduler = {"step": step, "lr": groups[0]["initial_lr"], "next_lr": groups[0]["lr"], "from": "torchtitan",
                 "last_epoch": last_epoch}
    return TagState(nxd_groups, content, scheduler, notes)
