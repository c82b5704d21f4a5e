"""The training position NxD's own code records beside its optimizer files, in nxdtrain's terms.

One mapping for both users: ``nxdtrain --resume`` of NxD's tag (:mod:`nxdtrain.checkpoint.nxd_resume`) and
``ckptconv reshard`` of it into an nxdtrain training tag (:mod:`ckptconv.training.tag_reshard`):

* the step: ``user_content.pt`` ``global_step`` (NxDT) or ``total_steps`` (NxD's ``run_llama_nxd.py``),
  checked against AdamW's step and the scheduler's ``last_epoch`` (``scheduler.pt``, or NxDT's
  ``lr_schedulers[0]``);
* the schedule: NxD's ``CosineAnnealing`` state (``max_steps``, ``warmup_steps``, ``min_lr``, ``base_lrs``,
  ``constant_steps`` 0) is nxdtrain's ``--schedule CosineAnnealing``; a scheduler whose state holds no
  such numbers (NxDT's ``LinearAnnealingWithWarmUp`` is a ``LambdaLR``: only ``base_lrs``) gives its peak lr;
* the data position: ``consumed_samples`` from an NxDT tag name; NxD's examples record only
  ``batch_idx``/``epoch`` of their own DataLoader (None here: the reader decides).

    >>> nxd_schedule({"max_steps": 10, "warmup_steps": 2, "constant_steps": 0, "min_lr": 0.001,
    ...               "base_lrs": [0.01, 0.01], "last_epoch": 2})[0]
    {'lr': 0.01, 'schedule': 'CosineAnnealing', 'min_lr': 0.001, 'warmup': 2, 'decay_steps': 10}
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptconv.errors import ConversionError
from ckptconv.training.nxdtrain_format.state import SCHEDULER_FILE, USER_CONTENT_FILE

COSINE_KEYS = ("max_steps", "warmup_steps", "constant_steps", "min_lr", "base_lrs")


def nxd_schedule(state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(nxdtrain's schedule record of NxD's scheduler state, lines on what it cannot say)."""
    lrs = [float(v) for v in state.get("base_lrs", [])]
    notes = []
    if len(set(lrs)) > 1:
        notes.append(f"NxD's param groups had peak learning rates {lrs}; nxdtrain's --lr sets one for all groups")
    record: dict[str, Any] = {"lr": lrs[0]} if lrs else {}
    if all(k in state for k in COSINE_KEYS) and int(state["constant_steps"]) == 0:
        record.update(schedule="CosineAnnealing", min_lr=float(state["min_lr"]), warmup=int(state["warmup_steps"]),
                      decay_steps=int(state["max_steps"]))
    elif all(k in state for k in COSINE_KEYS):
        notes.append(f"not carried: NxD's CosineAnnealing holds the peak for constant_steps "
                     f"{state['constant_steps']}, which nxdtrain's schedules do not")
    return record, notes


@dataclass(frozen=True)
class NxdPosition:
    """Where NxD's tag stands: its step, schedule record, data position (None: not recorded)."""

    step: int
    record: dict[str, Any]          # nxdtrain's schedule keys NxD's scheduler gives
    notes: list[str]                # what the schedule cannot carry
    consumed: int | None            # samples consumed, where the tag records them (NxDT's tag name)
    user: dict[str, Any]            # user_content.pt as NxD saved it
    scheduler_from: str | None      # where the scheduler state was found; None: nowhere
    kind: str                       # "NxDT" or "NxD"
    scheduler: dict[str, Any] | None = None  # the scheduler's state_dict() as saved


def _saved_step(user: dict[str, Any], scheduler: dict[str, Any] | None, optimizer_step: float, where: Path) -> int:
    """The optimizer step the tag was saved after; AdamW's, the trainer's and the scheduler's counts must agree."""
    counts = {"AdamW's step": int(optimizer_step)}
    counts.update({key: int(user[key]) for key in ("global_step", "total_steps") if isinstance(user.get(key), int)})
    if scheduler is not None and isinstance(scheduler.get("last_epoch"), int):
        counts["the scheduler's last_epoch"] = int(scheduler["last_epoch"])
    if len(set(counts.values())) > 1:
        raise ConversionError(f"{where}: the recorded steps disagree: "
                              + ", ".join(f"{k} {v}" for k, v in counts.items()) + "; resume with --weights-only")
    return next(iter(counts.values()))


def nxd_position(tag: Path, optimizer_step: float, load: Callable[[Path], Any]) -> NxdPosition:
    """The position of NxD's tag ``tag``; ``load`` reads a small side file (checked as its caller checks)."""
    user = load(tag / USER_CONTENT_FILE) if (tag / USER_CONTENT_FILE).is_file() else {}
    scheduler = load(tag / SCHEDULER_FILE) if (tag / SCHEDULER_FILE).is_file() else None
    where: str | None = SCHEDULER_FILE if scheduler is not None else None
    if not isinstance(user, dict):
        raise ConversionError(f"{tag / USER_CONTENT_FILE}: not a dict ({type(user).__name__}); resume with "
                              "--weights-only")
    if scheduler is None and isinstance(user.get("lr_schedulers"), list) and user["lr_schedulers"]:
        scheduler, where = user["lr_schedulers"][0], f"{USER_CONTENT_FILE} lr_schedulers[0]"
    if not isinstance(scheduler, (dict, type(None))):
        raise ConversionError(f"{tag}: {where} is not a dict ({type(scheduler).__name__}); resume with --weights-only")
    step = _saved_step(user, scheduler, optimizer_step, tag)
    record, notes = nxd_schedule(scheduler) if scheduler is not None else ({}, [])
    in_name = re.search(r"consumed_samples=(\d+(?:\.0*)?)", tag.name)
    consumed = int(float(in_name.group(1))) if in_name else None
    return NxdPosition(step, record, notes, consumed, user, where, "NxDT" if "global_step" in user else "NxD",
                       scheduler)
