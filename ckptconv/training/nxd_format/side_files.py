"""The side files of an NxD-format training tag, per trainer that resumes it (``--nxd-trainer``).

* ``nxd-example`` (NxD's example trainers, ``run_llama_nxd.py``): ``scheduler.pt`` = NxD's ``CosineAnnealing``
  state; ``user_content.pt`` = ``{total_steps, batch_idx, epoch, cli_args}``.
* ``nxdt`` (neuronx-distributed-training: PyTorch Lightning 2.5 + NeMo): no ``scheduler.pt``;
  ``user_content.pt`` = lightning's checkpoint dict without ``state_dict``/``optimizer_states`` (what NxDT's
  ``NLPCheckpointIO`` saves): ``epoch``, ``global_step``, ``pytorch-lightning_version``, ``loops`` (the fit
  loop's progress counters), ``callbacks`` (NxDT's checkpoint callback's state), ``lr_schedulers``
  (``[scheduler.state_dict()]``); the tag is named ``<name>--step=<N>-consumed_samples=<X>.ckpt``.

Only schedules whose state is exact are mapped: NxD's/NeMo's ``CosineAnnealing`` (``constant_steps`` 0; the
same state for both trainers) and NxDT's ``LinearAnnealingWithWarmUp`` (a ``LambdaLR``: its state holds only
counters and rates); anything else is refused by name. The structures are those of
``fixtures/nxdt-official/`` (NxD 2.28, lightning 2.5.0).

    >>> nxdt_tag_name("hf_llama", 2, 8)
    'hf_llama--step=2-consumed_samples=8.0.ckpt'
    >>> parse_nxdt_name("hf_llama--step=2-consumed_samples=8.0.ckpt")
    ('hf_llama', 2, '8.0')
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptconv.engine.options import NXD_TRAINERS
from ckptconv.errors import ConversionError
from ckptconv.training.nxd_format.write import NXDTRAIN_KEY
from ckptconv.training.nxdtrain_format.state import SCHEDULER_FILE, USER_CONTENT_FILE
from ckptconv.training.schedules import NXDT_SCHEDULES, Recorded, nxdt_lr

NXD_EXAMPLE, NXDT = NXD_TRAINERS
COSINE, LINEAR = NXDT_SCHEDULES
LIGHTNING_VERSION = "2.5.0"           # the lightning NxDT pins; the version its checkpoints record
CHECKPOINT_CALLBACK = "NeMoModelCheckpoint"  # NxDT's checkpoint callback (utils/exp_manager.py), its state key
COSINE_STATE = ("max_steps", "warmup_steps", "constant_steps", "decay_steps", "min_lr")
_NAME = re.compile(r"^(?P<prefix>.+)--step=(?P<step>\d+)-consumed_samples=(?P<consumed>[^/]+)\.ckpt$")


# --------------------------------------------------------------------------------------------
# The tag name


def consumed_text(consumed: int) -> str:
    """``consumed_samples`` as lightning puts it in the name: NxDT logs it as a Python float, which lightning
    holds as a float32 tensor, formatted through ``.item()`` (so above 2**24 samples it is float32-rounded)."""
    return str(torch.tensor(float(consumed), dtype=torch.float32).item())


def nxdt_tag_name(prefix: str, step: int, consumed: int) -> str:
    return _name(prefix, step, consumed_text(consumed))


def _name(prefix: str, step: int, consumed: str) -> str:
    return f"{prefix}--step={step}-consumed_samples={consumed}.ckpt"


def parse_nxdt_name(name: str) -> tuple[str, int, str] | None:
    """(prefix, step, consumed-samples text) of an NxDT tag name; None: not one."""
    found = _NAME.match(name)
    return (found["prefix"], int(found["step"]), found["consumed"]) if found else None


def nxdt_consumed(out: Path, step: int, consumed: int | None) -> int:
    """The consumed samples of OUT, checked: OUT must be NxDT's name for ``step`` and ``consumed`` (NxDT resumes
    its data from the name: a name its pattern misses silently restarts the data at sample 0). ``consumed``
    None (NxD's examples record none): taken from the name, which must then be in lightning's format."""
    parsed = parse_nxdt_name(out.name)
    prefix = parsed[0] if parsed else "<name>"
    if consumed is not None:
        right = nxdt_tag_name(prefix, step, consumed)
        if out.name != right:
            raise ConversionError(f"{out}: --nxd-trainer nxdt needs NxDT's tag name for step {step} and "
                                  f"{consumed} consumed samples: {right}")
        return consumed
    if parsed is None or parsed[1] != step:
        raise ConversionError(f"{out}: --nxd-trainer nxdt needs NxDT's tag name {_name(prefix, step, '<X>')}; "
                              "the source records no consumed "
                              "samples, so X (global batch x steps) comes from that name")
    try:
        value = float(parsed[2])
    except ValueError:
        value = float("nan")
    if not value.is_integer() or value < 0 or consumed_text(int(value)) != parsed[2]:
        raise ConversionError(f"{out}: consumed_samples={parsed[2]!r} is not a sample count as lightning writes "
                              f"it (e.g. {consumed_text(step)}; NxDT reads it with the pattern [0-9]+.[0-9]+)")
    return int(value)


# --------------------------------------------------------------------------------------------
# Scheduler states


def scheduler_state(record: Mapping[str, Any], step: int, groups: int, trainer: str) -> dict[str, Any]:
    """The scheduler's ``state_dict()`` at ``step`` for nxdtrain's schedule ``record``, as ``trainer`` holds it;
    any schedule without an exact counterpart there is refused by name (before a byte is written)."""
    schedule = record.get("schedule")
    allowed = (COSINE,) if trainer == NXD_EXAMPLE else (COSINE, LINEAR)
    if schedule not in allowed:
        raise ConversionError(f"schedule {schedule!r}: {_TRAINER_WORDS[trainer]} no such scheduler, so its "
                              f"scheduler state cannot be written; --nxd-trainer {trainer} needs a run trained with "
                              "schedule " + " or ".join(allowed))
    peak, max_steps, warmup = float(record["lr"]), int(record["decay_steps"]), int(record["warmup"])
    min_lr = float(record["min_lr"] or 0.0)
    last = nxdt_lr(step + 1, Recorded(str(schedule), peak, min_lr, float(warmup)), decay_steps=max_steps)
    counters = {"last_epoch": step, "_step_count": step + 1, "_is_initial": False,
                "_get_lr_called_within_step": False}
    if schedule == LINEAR:
        return {"base_lrs": [peak] * groups, **counters,
                "_last_lr": [last] * groups,
                "lr_lambdas": [{} for _ in range(groups)]}  # a functools.partial's __dict__, as LambdaLR saves it
    return {"max_steps": max_steps, "warmup_steps": warmup, "constant_steps": 0, "decay_steps": max_steps - warmup,
            "min_lr": min_lr, "base_lrs": [peak] * groups, **counters, "_last_lr": [last] * groups}


def schedule_kind(state: Mapping[str, Any]) -> str | None:
    """Which exact schedule a saved scheduler state is (COSINE, LINEAR); None: neither."""
    if all(k in state for k in COSINE_STATE) and int(state["constant_steps"]) == 0:
        return COSINE
    if "lr_lambdas" in state and "base_lrs" in state:
        return LINEAR  # a LambdaLR: the one NxDT registers (its lambda is the resuming run's own)
    return None


def carried_scheduler(state: Mapping[str, Any], trainer: str, where: str) -> dict[str, Any]:
    """A source scheduler state (NxD's or NxDT's tag) for ``trainer``: the same state where it has the class."""
    kind = schedule_kind(state)
    if kind is None or (trainer == NXD_EXAMPLE and kind != COSINE):
        raise ConversionError(f"{where}: {kind or 'a scheduler state with keys ' + str(sorted(state))}: "
                              f"{_TRAINER_WORDS[trainer]} no such scheduler; keep the source's own --nxd-trainer")
    return dict(state)


_TRAINER_WORDS = {NXD_EXAMPLE: "NxD's examples have", NXDT: "NxDT has"}


# --------------------------------------------------------------------------------------------
# user_content.pt


def nxd_example_content(step: int, cli_args: Mapping[str, Any]) -> dict[str, Any]:
    """NxD's examples' keys (``run_llama_nxd.py``); ``batch_idx`` of the step just taken."""
    return {"total_steps": step, "batch_idx": step - 1, "epoch": 0, "cli_args": dict(cli_args)}


def _progress(names: tuple[str, ...], *values: int) -> dict[str, dict[str, int]]:
    counts = dict(zip(names, values, strict=True))
    return {"total": dict(counts), "current": dict(counts)}


_OPT = ("ready", "completed")
_ZERO = ("ready", "completed", "started")
_BATCH = ("ready", "completed", "started", "processed")


def _batches(ready: int, completed: int, *, last: bool | None = False) -> dict[str, Any]:
    progress: dict[str, Any] = _progress(_BATCH, ready, completed, ready, ready)
    if last is not None:
        progress["is_last_batch"] = last
    return progress


def lightning_loops(step: int) -> dict[str, Any]:
    """Lightning 2.5's loop state of a fit saved by NxDT's checkpoint callback after optimizer step ``step``
    (automatic optimization, one batch per step, epoch 0): the save runs in ``on_train_batch_end``, so the
    batch counters' ``completed`` and ``_batches_that_stepped`` are one behind."""
    idle = {"state_dict": {}, "batch_progress": _batches(0, 0)}  # validate and test loops
    fit = {
        "state_dict": {},
        "epoch_loop.state_dict": {"_batches_that_stepped": step - 1},
        "epoch_loop.batch_progress": _batches(step, step - 1),
        "epoch_loop.scheduler_progress": _progress(_OPT, step, step),
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {
            "optimizer": {"step": _progress(_OPT, step, step), "zero_grad": _progress(_ZERO, step, step, step)}},
        "epoch_loop.manual_optimization.state_dict": {},
        "epoch_loop.manual_optimization.optim_step_progress": _progress(_OPT, 0, 0),
        "epoch_loop.val_loop.state_dict": {},
        "epoch_loop.val_loop.batch_progress": _batches(0, 0),
        "epoch_progress": _progress(_BATCH, 1, 0, 1, 0),
    }
    return {"fit_loop": fit, "validate_loop": idle, "test_loop": {**idle},
            "predict_loop": {"state_dict": {}, "batch_progress": _batches(0, 0, last=None)}}


def checkpoint_callback_key(every_n_train_steps: int) -> str:
    """NxDT's checkpoint callback's state key: lightning restores a state only into the callback whose class
    and settings (NxDT's configs: monitor step, mode max, every_n_epochs 0) give the same key."""
    settings = {"monitor": "step", "mode": "max", "every_n_train_steps": every_n_train_steps, "every_n_epochs": 0,
                "train_time_interval": None}
    return f"{CHECKPOINT_CALLBACK}{settings!r}"


def checkpoint_callback_state(out: Path, step: int) -> dict[str, Any]:
    """What lightning's ModelCheckpoint (monitor ``step``, top 1) holds right after saving OUT at ``step``."""
    path, score = str(out.absolute()), torch.tensor(step)  # lightning's "step" candidate: an int64 tensor
    return {"monitor": "step", "best_model_score": score, "best_model_path": path, "current_score": score.clone(),
            "dirpath": str(out.absolute().parent), "best_k_models": {path: score.clone()},
            "kth_best_model_path": path, "kth_value": score.clone(), "last_model_path": ""}


def nxdt_content(out: Path, step: int, scheduler: Mapping[str, Any], every_n_train_steps: int) -> dict[str, Any]:
    """``user_content.pt`` as NxDT's ``NLPCheckpointIO`` saves lightning's checkpoint dict at ``step`` (no
    NeMo ``hyper_parameters``: the NeMo model config is the resuming run's own)."""
    return {"epoch": 0, "global_step": step, "pytorch-lightning_version": LIGHTNING_VERSION,
            "loops": lightning_loops(step),
            "callbacks": {checkpoint_callback_key(every_n_train_steps): checkpoint_callback_state(out, step)},
            "lr_schedulers": [dict(scheduler)]}


# --------------------------------------------------------------------------------------------
# The side files of one rewrite

@dataclass
class SideFiles:
    """What a rewrite writes beside NxD's optimizer files for ``trainer``."""

    blobs: dict[str, Any] = field(default_factory=dict)   # file name -> the object torch.save writes
    copies: list[str] = field(default_factory=list)       # side files copied from the source as they are
    lr: tuple[float, float] | None = None                 # (next, peak) lr of the param groups; None: source's
    consumed: int | None = None                           # the samples consumed, where known
    notes: list[str] = field(default_factory=list)


def _every(options: Mapping[str, Any], step: int) -> tuple[int, str]:
    freq = options.get("checkpoint_freq")
    if isinstance(freq, int) and freq > 0:
        return freq, f"every_n_train_steps {freq} (the run's --checkpoint-freq)"
    return step, f"every_n_train_steps {step} (the step saved; the run recorded no --checkpoint-freq)"


def _callback_note(every: str) -> str:
    return (f"callbacks: NxDT's {CHECKPOINT_CALLBACK} state (monitor step, mode max, {every}); lightning restores "
            "it only into a callback with these settings, else it warns and starts that callback afresh")


def from_nxdtrain(trainer: str, out: Path, content: Mapping[str, Any], record: Mapping[str, Any],
                  groups: int) -> SideFiles:
    """Side files for nxdtrain's tag (``content`` its user_content, ``record`` its schedule), nxdtrain's own
    record kept under :data:`NXDTRAIN_KEY` (``nxdtrain run --resume`` continues exactly from it)."""
    step = int(content["step"])
    state = scheduler_state(record, step, groups, trainer)  # refuses a schedule the trainer has not
    options = dict(content.get("options", {}))
    files = SideFiles(lr=(float(state["_last_lr"][0]), float(record["lr"])), consumed=content.get("consumed_samples"))
    if trainer == NXD_EXAMPLE:
        files.blobs[SCHEDULER_FILE] = state
        user = nxd_example_content(step, options)
        files.notes.append(f"side files: NxD's {record['schedule']} scheduler.pt; user_content.pt with NxD's "
                           "example keys (total_steps, batch_idx = step - 1, epoch 0, cli_args = the run's "
                           "options) and nxdtrain's own position under 'nxdtrain'; RNG states dropped")
    else:
        consumed = nxdt_consumed(out, step, content.get("consumed_samples"))
        content = {**content, "consumed_samples": consumed}
        files.consumed = consumed
        every, said = _every(options, step)
        user = nxdt_content(out, step, state, every)
        files.notes += [f"side files: NxDT's (no scheduler.pt; user_content.pt = lightning {LIGHTNING_VERSION}'s "
                        f"checkpoint dict at global_step {step}, epoch 0, the fit loop's counters, lr_schedulers "
                        f"[{record['schedule']} state]) and nxdtrain's own position under 'nxdtrain'; RNG states "
                        "dropped; no NeMo hyper_parameters (the resuming run's config is its own)",
                        _callback_note(said)]
    user[NXDTRAIN_KEY] = {"user_content": dict(content), "scheduler": {**record, "step": step}}
    files.blobs[USER_CONTENT_FILE] = user
    return files


def from_nxd_tag(trainer: str, out: Path, *, kind: str, step: int, consumed: int | None,
                 scheduler: Mapping[str, Any] | None, where: str | None, user: Mapping[str, Any],
                 present: list[str]) -> SideFiles:
    """Side files for a tag of NxD's own code (``kind`` "NxD": an example's, "NxDT"), whose ``present`` side
    files are copied as they are for its own trainer and mapped (scheduler state carried) for the other."""
    ours = user.get(NXDTRAIN_KEY)
    if consumed is None and isinstance(ours, dict) and isinstance(ours.get("user_content"), dict):
        recorded = ours["user_content"].get("consumed_samples")  # a tag nxdtrain/ckptconv wrote: its own record
        consumed = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None
    if trainer == NXDT:
        consumed = nxdt_consumed(out, step, consumed)
    files = SideFiles(consumed=consumed)
    if trainer == (NXDT if kind == "NxDT" else NXD_EXAMPLE):
        files.copies = list(present)
        files.notes.append(f"side files: {kind}'s {' and '.join(present) or 'none'} copied as they are")
        return files
    if scheduler is None:
        raise ConversionError(f"{out}: --nxd-trainer {trainer}: the {kind} source holds no scheduler state to map")
    state = carried_scheduler(scheduler, trainer, f"{where}")
    if trainer == NXD_EXAMPLE:
        files.blobs[SCHEDULER_FILE] = state
        content = nxd_example_content(step, {})
        files.notes.append(f"side files: NxDT's scheduler state as NxD's scheduler.pt; user_content.pt with NxD's "
                           f"example keys at step {step} (epoch 0, cli_args empty); NxDT's loops and callbacks "
                           "not carried")
    else:
        options = ours["user_content"].get("options", {}) if isinstance(ours, dict) and isinstance(
            ours.get("user_content"), dict) else {}
        every, said = _every(options if isinstance(options, dict) else {}, step)
        content = nxdt_content(out, step, state, every)
        files.notes += [f"side files: NxD's scheduler.pt as NxDT's lr_schedulers[0]; user_content.pt = lightning "
                        f"{LIGHTNING_VERSION}'s checkpoint dict at global_step {step}, epoch 0 (NxD's batch_idx "
                        f"and epoch not carried), consumed samples {consumed}", _callback_note(said)]
    if isinstance(user.get(NXDTRAIN_KEY), dict):
        content[NXDTRAIN_KEY] = user[NXDTRAIN_KEY]  # a tag ckptconv/nxdtrain wrote: nxdtrain's record goes along
    files.blobs[USER_CONTENT_FILE] = content
    return files
