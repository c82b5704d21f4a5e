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
from ckptconv.titan.names import PARAM_GROUP_FIELDS, param_group_key, trained_params
from ckptconv.training.schedules import Recorded, lr_at
from ckptconv.training.state import is_matrix

# The fields that choose torch's implementation, not the math: TorchTitan picks its own on its device.
IMPLEMENTATION = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}
# The fields whose values are the run's AdamW (carried as the tag recorded them).
MATH_FIELDS = ("betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
OUR_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "linear"}  # nxdtrain's -> TorchTitan decay_type


def titan_last_epoch(*, step: int, warmup: int) -> int:
    """``lr_scheduler.last_epoch`` for a tag at ``step`` (see the module docstring: past warmup, one more)."""
    return step + 1 if step >= warmup else step


@dataclass(frozen=True)
class TitanSchedule:
    """TorchTitan's configuration that continues an nxdtrain schedule (its config field names)."""

    lr: float
    warmup_steps: int
    decay_type: str
    min_lr_factor: float
    total_steps: int

    def describe(self) -> str:
        return (f"optimizer.lr={self.lr:g}, lr_scheduler.warmup_steps={self.warmup_steps}, "
                f"lr_scheduler.decay_type={self.decay_type}, lr_scheduler.min_lr_factor={self.min_lr_factor:g}, "
                f"lr_scheduler.total_steps={self.total_steps} (or training.steps), lr_scheduler.decay_ratio unset")


def titan_schedule(record: Mapping[str, Any], where: str) -> tuple[Recorded, int, TitanSchedule | None]:
    """The tag's schedule, its decay steps, and TorchTitan's equivalent (None: TorchTitan has none)."""
    try:
        schedule = Recorded(str(record["schedule"]), float(record["lr"]), record.get("min_lr"),
                            float(record.get("warmup") or 0))
        decay_steps = int(record["decay_steps"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConversionError(f"{where}: no nxdtrain schedule record ({exc}); expected schedule, lr, min_lr, warmup, "
                              "decay_steps") from None
    if schedule.warmup != int(schedule.warmup):
        raise ConversionError(f"{where}: warmup {schedule.warmup} is not a step count")
    if schedule.schedule not in OUR_SCHEDULES:
        return schedule, decay_steps, None
    floor = 1.0 if schedule.schedule == "constant" else float(schedule.min_lr or 0.0) / schedule.lr
    return schedule, decay_steps, TitanSchedule(schedule.lr, int(schedule.warmup), OUR_SCHEDULES[schedule.schedule],
                                                floor, decay_steps)


def titan_values(spec: ModelSpec, param_groups: list[dict[str, Any]], scheduler: Mapping[str, Any],
                 content: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """TorchTitan's param-group, lr-scheduler and train-state values for a tag at ``content["step"]``, and what
    to tell the user (how to configure TorchTitan; what could not be carried exactly)."""
    step = int(content["step"])
    schedule, decay_steps, titan = titan_schedule(scheduler, where)
    if not param_groups:
        raise ConversionError(f"{where}: the tag's optimizer files record no param groups")
    missing = [f for g in param_groups for f in MATH_FIELDS if f not in g]
    if missing:
        raise ConversionError(f"{where}: the tag's param group has no {missing[0]!r}; not torch AdamW state "
                              "(TorchTitan's checkpoint needs AdamW): pass --weights-only for the model alone")
    groups = [{"lr": lr_at(step + 1, schedule, decay_steps=decay_steps), "initial_lr": schedule.lr,
               **{f: g[f] for f in MATH_FIELDS}, **IMPLEMENTATION} for g in param_groups]
    assert set(groups[0]) == set(PARAM_GROUP_FIELDS), sorted(set(groups[0]) ^ set(PARAM_GROUP_FIELDS))
    values: dict[str, Any] = {}
    for param in trained_params(spec):  # nxdtrain's groups: matrices, then vectors (the norm weights)
        group = groups[0 if is_matrix(param.shape) or len(groups) == 1 else 1]
        values.update({param_group_key(param.key, f): group[f] for f in PARAM_GROUP_FIELDS})
    notes = []
    differ = [f for f in MATH_FIELDS if len(groups) > 1 and groups[1][f] != groups[0][f]]
    if differ:
        notes.append(f"the norm weights have their own AdamW group ({', '.join(f'{f} {groups[1][f]!r}' for f in differ)}"
                     f"; matrices {', '.join(f'{f} {groups[0][f]!r}' for f in differ)}): give TorchTitan's optimizer "
                     "a param group for them, pattern 'norm\\.weight$', before its catch-all '.*' (with one group "
                     "torch refuses to load differing values)")
    if titan is None:
        last_epoch = step
        notes.append(f"TorchTitan has no schedule equal to NxDT's {schedule.schedule}: the next step runs at "
                     "nxdtrain's lr, the steps after at TorchTitan's own schedule")
    else:
        last_epoch = titan_last_epoch(step=step, warmup=titan.warmup_steps)
        notes.append(f"continue in TorchTitan with {titan.describe()}: from step {step + 1} to {decay_steps} its lr "
                     "is nxdtrain's"
                     + ("" if last_epoch > step else " through warmup, its decay then one step later (the tag is "
                        "still in warmup)"))
    seq_len = content.get("options", {}).get("seq_len")
    consumed = content.get("consumed_samples", 0)  # None: resharded from NxD's tag, which records none
    values.update({"lr_scheduler.last_epoch": last_epoch, "train_state.step": step,
                   "train_state.ntokens_seen": int(consumed) * int(seq_len) if seq_len and consumed is not None else 0})
    seen = f"nxdtrain consumed {int(consumed)} samples" if consumed is not None else "the tag records no consumed samples"
    notes.append(f"not carried: the data loader position ({seen}; TorchTitan's "
                 "loader starts its data from the beginning: skip those rows, or continue on other data)")
    return values, notes


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
