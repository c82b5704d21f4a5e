"""The training position of a tag written by NxD's own code (NxD's examples, NxDT), in nxdtrain's terms.

NxD's optimizer files are read through :class:`ckptconv.training.nxd_format.as_source.NxdTagOptimizer`; this module
maps the side files (``torch.load(weights_only=True)``, checked against the tag's records where it has them):
step, schedule and data position as :mod:`ckptconv.training.nxd_format.position` maps them (shared with ``ckptconv reshard``
of NxD's tag); NxD's examples record no consumed samples, so the data continues at step x ``--gbs`` (said so).

The RNG states and NxD's data order are never carried (said in one line).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ckptconv.errors import ConversionError
from ckptconv.io import CheckedFiles
from ckptconv.training import NXDTRAIN_KEY, USER_CONTENT_FILE, NxdOptimizer, NxdTagOptimizer, OptimFormat, nxd_position
from nxdtrain.checkpoint.continuity import LABELS
from nxdtrain.checkpoint.resume import TrainingState, damaged, load_side_file, training_state_of
from nxdtrain.errors import TrainError


def _hyper(groups: list[dict[str, Any]]) -> str:
    """The carried hyper-parameters of nxdtrain's two groups, in words."""
    def one(g: dict[str, Any]) -> str:
        return (f"betas {tuple(g.get('betas', ()))}, eps {g.get('eps')}, weight decay {g.get('weight_decay')}")
    return "; ".join(f"{kind} {one(g)}" for kind, g in zip(("matrices", "vectors"), groups, strict=False))


def _ours_in_nxd_format(tag: Path, ours: dict[str, Any], step: int, gbs: int, *, zero1: bool, masters: bool,
                        described: str) -> tuple[TrainingState, list[str]]:
    """A tag nxdtrain (or ``ckptconv reshard --optimizer-format nxd``) wrote in NxD's format: the position,
    schedule and data order from nxdtrain's own records it keeps in ``user_content.pt['nxdtrain']``."""
    state = training_state_of(ours["user_content"], ours["scheduler"], tag, gbs=gbs)
    if state.step != step:
        raise TrainError(f"{tag / USER_CONTENT_FILE}: nxdtrain's record is at step {state.step}, NxD's keys and "
                         f"optimizer at step {step}; resume with --weights-only")
    options = {**state.options, "zero1": zero1}
    lines = [f"NxD-format tag written by nxdtrain/ckptconv: AdamW's step and moments{' and the fp32 masters' if masters else ''} "
             f"from its optimizer files ({described}), step {step}; position, schedule and data order from "
             f"{USER_CONTENT_FILE}['{NXDTRAIN_KEY}']", *state.notes]
    return dataclasses.replace(state, options=options, notes=[]), lines


def read_nxd_state(tag: Path, checks: CheckedFiles | None, *, gbs: int) -> tuple[TrainingState, list[str]]:
    """The training state of NxD's tag ``tag`` and the lines that say what is mapped and what is not."""
    try:
        with NxdOptimizer.open(tag, io="read", lazy=True) as optim:  # the first rank's files say what it is
            zero1, masters, optimizer_step = optim.format is not OptimFormat.ADAMW, optim.has_masters, optim.step()
            described = f"{optim.format.value}, dp {optim.dp}"
            as_ours = NxdTagOptimizer(optim)
            groups = as_ours.hyper.param_groups  # refused here, before any step, if not ours
            unsaved = bool(optim.model.unsaved_tensors())
            precision = as_ours.precision
    except ConversionError as exc:
        raise TrainError(f"--resume {tag}: {damaged(exc)}") from None
    try:
        position = nxd_position(tag, optimizer_step, lambda path: load_side_file(path, checks))
    except TrainError:
        raise
    except ConversionError as exc:
        raise TrainError(str(exc)) from None
    step, record, notes, user, where = (position.step, position.record, position.notes, position.user,
                                        position.scheduler_from)
    ours = user.get(NXDTRAIN_KEY)
    if isinstance(ours, dict) and isinstance(ours.get("user_content"), dict) and isinstance(ours.get("scheduler"), dict):
        return _ours_in_nxd_format(tag, ours, step, gbs, zero1=zero1, masters=masters, described=described)
    if position.consumed is not None:
        consumed = position.consumed
        data = f"the data continues at sample {consumed} (the tag name's consumed_samples)"
    else:
        consumed = step * gbs
        recorded = ", ".join(f"{k} {user[k]}" for k in ("batch_idx", "epoch") if k in user) or "nothing"
        data = (f"the data continues at sample {consumed} = step {step} x --gbs {gbs} (NxD's tag records "
                f"{recorded} of its own DataLoader, no consumed samples)")
    kind = position.kind
    missing = [LABELS[k] for k in ("schedule", "lr", "min_lr", "warmup", "decay_steps") if k not in record]
    lines = [f"{kind}'s own tag: AdamW's step and moments{' and the fp32 masters' if masters else ''} from its "
             f"optimizer files ({described}), step {step}"
             + (f", the schedule from {where}" if where is not None else "")
             + (f" (CosineAnnealing, warmup {record['warmup']}, max steps {record['decay_steps']}, lr {record['lr']:g},"
                f" min lr {record['min_lr']:g})" if "schedule" in record else ""),
             f"AdamW's hyper-parameters from NxD's param groups: {_hyper(groups)}",
             *notes]
    if missing:
        lines.append(f"not carried: {', '.join(missing)} ({where if where is not None else 'no scheduler state'}"
                     " does not record them): this run's flags are used")
    options = {"precision": precision, "optimizer": "adamw", "zero1": zero1}
    if unsaved:
        lines.append("weights: NxD's master weights in optim/ (the model files hold no tensors: saved with "
                     "avoid_saving_lower_precision_weights)")
    if zero1 and not masters and options["precision"] == "bf16":
        lines.append("not carried: NxD's fp32 master weights (saved without use_master_weights_in_ckpt): they restart "
                     "from the bf16 weights, as NxD's own resume of this tag does")
    lines.append(f"not carried: NxD's data order; {data}")
    return TrainingState(step, consumed, [], options, record, []), lines
