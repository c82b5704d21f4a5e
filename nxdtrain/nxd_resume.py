"""The training position of a tag written by NxD's own code (NxD's examples, NxDT), in nxdtrain's terms.

NxD's optimizer files are read through :class:`ckptconv.nxd_tag_optimizer.NxdTagOptimizer`; this module
maps the side files (``torch.load(weights_only=True)``, checked against the tag's records where it has them):

* the step: ``user_content.pt`` ``global_step`` (NxDT) or ``total_steps`` (NxD's ``run_llama_nxd.py``),
  checked against the scheduler's ``last_epoch`` (``scheduler.pt``, or NxDT's ``lr_schedulers[0]``);
* the schedule: NxD's ``CosineAnnealing`` state (``max_steps``, ``warmup_steps``, ``min_lr``, ``base_lrs``,
  ``constant_steps`` 0) is nxdtrain's ``--schedule CosineAnnealing`` (:mod:`nxdtrain.schedules`), recorded
  so that a resume with other values is refused as for nxdtrain's own tags; a scheduler whose state holds
  no such numbers (NxDT's ``LinearAnnealingWithWarmUp`` is a ``LambdaLR``: only ``base_lrs``) gives its
  peak lr, the rest is this run's and said so;
* the data position: ``consumed_samples`` from an NxDT tag name; NxD's examples record only
  ``batch_idx``/``epoch`` of their own DataLoader, so the data continues at step x ``--gbs`` (said so).

The RNG states and NxD's data order are never carried (said in one line).

    >>> nxd_schedule({"max_steps": 10, "warmup_steps": 2, "constant_steps": 0, "min_lr": 0.001,
    ...               "base_lrs": [0.01, 0.01], "last_epoch": 2})[0]
    {'lr': 0.01, 'schedule': 'CosineAnnealing', 'min_lr': 0.001, 'warmup': 2, 'decay_steps': 10}
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ckptconv.errors import ConversionError
from ckptconv.io.checked import CheckedFiles
from ckptconv.io.nxd import NxdCheckpoint
from ckptconv.nxd_optimizer import NxdOptimizer, OptimFormat
from ckptconv.nxd_tag_optimizer import NxdTagOptimizer
from ckptconv.training_state import SCHEDULER_FILE, USER_CONTENT_FILE
from nxdtrain.checkpoint import TrainingState, damaged, load_small
from nxdtrain.continuity import LABELS
from nxdtrain.errors import TrainError

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


def _saved_step(user: dict[str, Any], scheduler: dict[str, Any] | None, optimizer_step: float, where: Path) -> int:
    """The optimizer step the tag was saved after; AdamW's, the trainer's and the scheduler's counts must agree."""
    counts = {"AdamW's step": int(optimizer_step)}
    counts.update({key: int(user[key]) for key in ("global_step", "total_steps") if isinstance(user.get(key), int)})
    if scheduler is not None and isinstance(scheduler.get("last_epoch"), int):
        counts["the scheduler's last_epoch"] = int(scheduler["last_epoch"])
    if len(set(counts.values())) > 1:
        raise TrainError(f"{where}: the recorded steps disagree: "
                         + ", ".join(f"{k} {v}" for k, v in counts.items()) + "; resume with --weights-only")
    return next(iter(counts.values()))


def _hyper(groups: list[dict[str, Any]]) -> str:
    """The carried hyper-parameters of nxdtrain's two groups, in words."""
    def one(g: dict[str, Any]) -> str:
        return (f"betas {tuple(g.get('betas', ()))}, eps {g.get('eps')}, weight decay {g.get('weight_decay')}")
    return "; ".join(f"{kind} {one(g)}" for kind, g in zip(("matrices", "vectors"), groups, strict=False))


def _precision(root: Path) -> str:
    """nxdtrain's precision of NxD's model files: bf16 weights (fp32 masters in the optimizer) or fp32."""
    with NxdCheckpoint(root, io="read") as ckpt:
        dtypes = {d for f in ckpt.files for d, _ in ckpt.declared(f).values()}
    return "bf16" if torch.bfloat16 in dtypes else "fp32"


def read_nxd_state(tag: Path, checks: CheckedFiles | None, *, gbs: int) -> tuple[TrainingState, list[str]]:
    """The training state of NxD's tag ``tag`` and the lines that say what is mapped and what is not."""
    try:
        with NxdOptimizer.open(tag, io="read") as optim:
            zero1, masters, optimizer_step = optim.format is not OptimFormat.ADAMW, optim.has_masters, optim.step()
            described = f"{optim.format.value}, dp {optim.dp}"
            groups = NxdTagOptimizer(optim).hyper.param_groups  # refused here, before any step, if not ours
            unsaved = bool(optim.model.unsaved_tensors())
    except ConversionError as exc:
        raise TrainError(f"--resume {tag}: {damaged(exc)}") from None
    user = load_small(tag / USER_CONTENT_FILE, checks) if (tag / USER_CONTENT_FILE).is_file() else {}
    scheduler = load_small(tag / SCHEDULER_FILE, checks) if (tag / SCHEDULER_FILE).is_file() else None
    where = SCHEDULER_FILE
    if not isinstance(user, dict):
        raise TrainError(f"{tag / USER_CONTENT_FILE}: not a dict ({type(user).__name__}); resume with --weights-only")
    if scheduler is None and isinstance(user.get("lr_schedulers"), list) and user["lr_schedulers"]:
        scheduler, where = user["lr_schedulers"][0], f"{USER_CONTENT_FILE} lr_schedulers[0]"
    if not isinstance(scheduler, (dict, type(None))):
        raise TrainError(f"{tag}: {where} is not a dict ({type(scheduler).__name__}); resume with --weights-only")
    step = _saved_step(user, scheduler, optimizer_step, tag)
    record, notes = nxd_schedule(scheduler) if scheduler is not None else ({}, [])
    consumed_in_name = re.search(r"consumed_samples=(\d+(?:\.0*)?)", tag.name)
    if consumed_in_name:
        consumed = int(float(consumed_in_name.group(1)))
        position = f"the data continues at sample {consumed} (the tag name's consumed_samples)"
    else:
        consumed = step * gbs
        recorded = ", ".join(f"{k} {user[k]}" for k in ("batch_idx", "epoch") if k in user) or "nothing"
        position = (f"the data continues at sample {consumed} = step {step} x --gbs {gbs} (NxD's tag records "
                    f"{recorded} of its own DataLoader, no consumed samples)")
    kind = "NxDT" if "global_step" in user else "NxD"
    missing = [LABELS[k] for k in ("schedule", "lr", "min_lr", "warmup", "decay_steps") if k not in record]
    lines = [f"{kind}'s own tag: AdamW's step and moments{' and the fp32 masters' if masters else ''} from its "
             f"optimizer files ({described}), step {step}"
             + (f", the schedule from {where}" if scheduler is not None else "")
             + (f" (CosineAnnealing, warmup {record['warmup']}, max steps {record['decay_steps']}, lr {record['lr']:g},"
                f" min lr {record['min_lr']:g})" if "schedule" in record else ""),
             f"AdamW's hyper-parameters from NxD's param groups: {_hyper(groups)}",
             *notes]
    if missing:
        lines.append(f"not carried: {', '.join(missing)} ({where if scheduler is not None else 'no scheduler state'}"
                     " does not record them): this run's flags are used")
    options = {"precision": _precision(tag), "optimizer": "adamw", "zero1": zero1}
    if unsaved:
        lines.append("weights: NxD's master weights in optim/ (the model files hold no tensors: saved with "
                     "avoid_saving_lower_precision_weights)")
    if zero1 and not masters and options["precision"] == "bf16":
        lines.append("not carried: NxD's fp32 master weights (saved without use_master_weights_in_ckpt): they restart "
                     "from the bf16 weights, as NxD's own resume of this tag does")
    lines.append(f"not carried: NxD's data order; {position}")
    return TrainingState(step, consumed, [], options, record, []), lines
