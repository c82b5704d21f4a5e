"""A resume keeps the run: its learning-rate schedule and data order are recorded in every tag and compared.

Every tag's ``user_content.pt`` holds the run's settings (:func:`run_settings`; its position is ckptconv.json's
``ckptconv.engine.tags.run_record``): the schedule as resolved
(a warmup fraction and ``--epochs`` already turned into steps, ``decay_steps`` defaulted from
``--steps``) and what fixes the data order. A resume whose record differs is refused in one line
naming each old and new value, unless ``--override-schedule`` (Megatron's switch of that name),
which says exactly what changed. Tags written before the record existed: what their
``scheduler.pt`` and options hold is used, and what is missing is said to be assumed. AdamW's
hyper-parameters (weight decay, betas, eps) come from the tag's param groups: an explicit flag that
differs is refused the same way (:func:`optimizer_groups`).

    >>> old = {"schedule": "cosine", "lr": 3e-4, "min_lr": 3e-5, "warmup": 10, "decay_steps": 100,
    ...        "seed": 1, "shuffle": True, "epochs": None}
    >>> changes(old, {**old, "decay_steps": 200})
    ['decay steps 100 -> 200']
"""

from __future__ import annotations

import uuid
from typing import Any

from ckptconv.core import human_number
from nxdtrain.config.options import OptimConfig, TrainConfig
from nxdtrain.errors import TrainError

SCHEDULE_KEYS = ("schedule", "lr", "min_lr", "warmup", "decay_steps", "norm_weight_decay")
ORDER_KEYS = ("seed", "shuffle")
# Who wrote a tag that records no run: scheduler.pt's "from" (ckptconv from-dcp writes "torchtitan" there), its words
ORIGIN = "from"
ORIGINS = {"torchtitan": "from TorchTitan's DCP, which holds no schedule"}
NORMS_BEFORE = False  # a tag that records no norm_weight_decay: nxdtrain never decayed norm weights before it
LABELS = {"schedule": "schedule", "lr": "peak lr", "min_lr": "min lr", "warmup": "warmup steps",
          "decay_steps": "decay steps", "norm_weight_decay": "weight decay on norm weights", "seed": "seed", "shuffle": "shuffle", "epochs": "epochs"}
FLAGS = {"schedule": "--schedule", "lr": "--lr", "min_lr": "--min-lr", "warmup": "--warmup",
         "decay_steps": "--decay-steps (default: --steps)",
         "norm_weight_decay": "--norm-weight-decay/--no-norm-weight-decay (NxDT: model.do_layer_norm_weight_decay)",
         "seed": "--seed", "shuffle": "--shuffle/--no-shuffle",
         "epochs": "--epochs"}


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def run_settings(config: TrainConfig, *, epochs: int | None, run: str) -> dict[str, Any]:
    """What a tag records of the run (``config`` resolved: warmup and decay steps are step counts)."""
    optim = config.optim
    return {"schedule": optim.schedule, "lr": optim.lr, "min_lr": optim.min_lr, "warmup": int(optim.warmup),
            "decay_steps": config.decay_steps, "norm_weight_decay": optim.norm_weight_decay, "seed": config.seed, "shuffle": config.data.shuffle, "epochs": epochs,
            "run": run}


def recorded_run(user: dict[str, Any], scheduler: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The run record of a tag, and the keys it did not hold (an older tag: what it has is pieced together
    from ``scheduler.pt`` and the saved options)."""
    record = user.get("run")
    if isinstance(record, dict):
        return {"norm_weight_decay": NORMS_BEFORE, **record}, []
    options = user.get("options") or {}
    pieced: dict[str, Any] = {"norm_weight_decay": NORMS_BEFORE, ORIGIN: scheduler.get(ORIGIN)}
    for key in SCHEDULE_KEYS:
        if key in scheduler:
            pieced[key] = scheduler[key]
    for key in ORDER_KEYS:
        if key in options:
            pieced[key] = options[key]
    return pieced, [k for k in (*SCHEDULE_KEYS, *ORDER_KEYS) if k not in pieced]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)), abs(float(b)))
    return bool(a == b)


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The recorded values this run changes (epochs only where both runs gave it)."""
    return [key for key in (*SCHEDULE_KEYS, *ORDER_KEYS, "epochs")
            if key in old and key in new and not (key == "epochs" and (old[key] is None or new[key] is None))
            and not _same(old[key], new[key])]


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``'<what> OLD -> NEW'`` for each recorded value this run changes (:func:`changed_keys`)."""
    return [f"{LABELS[key]} {_value(old[key])} -> {_value(new[key])}" for key in changed_keys(old, new)]


def _value(value: Any) -> str:
    """A recorded value as the notes say it: a number without its binary noise (``0.0003``, not
    ``0.00030000000000000003``)."""
    return human_number(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def check_resume(old: dict[str, Any], missing: list[str], new: dict[str, Any], *, tag: str,
                 override: bool) -> list[str]:
    """Lines for the log; raise when this run's schedule or data order differs from the tag's and
    ``--override-schedule`` was not given."""
    notes = []
    if missing:
        assumed = ", ".join(f"{LABELS[k]} {_value(new[k])}" for k in missing)
        origin = ORIGINS.get(str(old.get(ORIGIN)), "an older tag")
        notes.append(f"{tag} records no {', '.join(LABELS[k] for k in missing)} ({origin}): assuming this "
                     f"run's ({assumed})")
    keys = changed_keys(old, new)
    if not keys:
        return notes
    changed = changes(old, new)
    if not override:
        flags = ", ".join(sorted({FLAGS[key] for key in keys}))
        raise TrainError(f"--resume: this run changes what {tag} recorded: {'; '.join(changed)}; resume with the "
                         f"recorded values ({flags}), or pass --override-schedule to change the run on purpose")
    notes.append(f"--override-schedule: the run changes at this resume: {'; '.join(changed)}")
    return notes


OPTIMIZER_FLAGS = {"weight_decay": "--weight-decay", "beta1": "--beta1", "beta2": "--beta2", "eps": "--eps"}


def _recorded_optimizer(group: dict[str, Any]) -> dict[str, Any]:
    betas = group.get("betas")
    values = {"weight_decay": group.get("weight_decay"), "eps": group.get("eps")}
    if isinstance(betas, (list, tuple)) and len(betas) == 2:
        values.update(beta1=betas[0], beta2=betas[1])
    return {k: v for k, v in values.items() if v is not None}


def optimizer_groups(groups: list[dict[str, Any]], optim: OptimConfig, given: frozenset[str], *, tag: str,
                     override: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """The param groups a resume loads, and lines for the log: the tag's, unless a flag the user gave
    (``--weight-decay``, ``--beta1/--beta2``, ``--eps``) differs from what its first group (the matrices)
    records: refused naming both values, or with ``override`` (``--override-schedule``) the flag's value in every
    group (the weight decay only where a group decays as the first does: norm weights at 0 stay at 0).

        >>> optimizer_groups([{"weight_decay": 0.01, "betas": (0.9, 0.95), "eps": 1e-8}], OptimConfig(weight_decay=0.1),
        ...                  frozenset({"weight_decay"}), tag="t", override=True)[1]
        ['--override-schedule: AdamW changes at this resume: --weight-decay 0.1 (t records 0.01)']
    """
    if not groups:
        return groups, []
    recorded = _recorded_optimizer(groups[0])
    keys = [k for k in OPTIMIZER_FLAGS if k in given and k in recorded and not _same(recorded[k], getattr(optim, k))]
    if not keys:
        return groups, []
    said = "; ".join(f"{OPTIMIZER_FLAGS[k]} {getattr(optim, k):g} ({tag} records {recorded[k]:g})" for k in keys)
    if not override:
        raise TrainError(f"--resume: {said}: the tag's AdamW param groups would be loaded over the flag; drop "
                         f"{', '.join(OPTIMIZER_FLAGS[k] for k in keys)} (or give the recorded value), or pass "
                         "--override-schedule to change it on purpose")
    changed = []
    for group in groups:
        new = dict(group)
        if "weight_decay" in keys and _same(group.get("weight_decay", 0.0), recorded["weight_decay"]):
            new["weight_decay"] = optim.weight_decay
        if "beta1" in keys or "beta2" in keys:
            b1, b2 = group["betas"]
            new["betas"] = (optim.beta1 if "beta1" in keys else b1, optim.beta2 if "beta2" in keys else b2)
        if "eps" in keys:
            new["eps"] = optim.eps
        changed.append(new)
    return changed, [f"--override-schedule: AdamW changes at this resume: {said}"]
