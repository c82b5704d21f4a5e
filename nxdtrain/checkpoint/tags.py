"""A checkpoint directory's tags: which ones a run wrote and may delete (retention, the completion of an interrupted
NxD-format rewrite), and the one run allowed to write there. What a tag is (its name, its markers):
:mod:`ckptconv.io.tags`; how it is written: :mod:`ckptconv.engine.tags`.

A tag ``<checkpoint_dir>/step_<N>/`` holds::

    model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt   one shard per (tp, pp), written by ckptconv.io.nxd_write.save_shard
    optim/dp_rank_DD_tp_rank_XX_pp_rank_YY.pt   optimizer state by parameter name (+ fp32 masters with bf16; the
                                                format of ckptconv.training.nxdtrain_format.state); DD > 0 only with ZeRO-1
    scheduler.pt, user_content.pt               step, consumed samples, RNG states, the run's options
    hf/                                         config.json and tokenizer files carried from the source
    ckptconv.json                               layout, flavour, dtype, size + digest of every file
    checkpoint, done                            markers, written last (ckptconv.io.tags.write_markers)

Written by :mod:`nxdtrain.checkpoint.save`; resumed from by the rules of :mod:`nxdtrain.checkpoint.resume`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptconv.core import MODEL_DIR
from ckptconv.engine import RECORD_KEY, outdir, remove_tag
from ckptconv.errors import ConversionError
from ckptconv.io import DONE_MARKER, completed_tags, is_step_tag, read_metadata, tag_step
from ckptconv.training import optimizer_file
from nxdtrain.config.preflight import check_writable
from nxdtrain.errors import TrainError

# The hidden siblings of a tag while --optimizer-format nxd rewrites it: the rewrite, then the replaced tag.
NXD_REWRITE_SUFFIX = ".nxd-format"
REPLACED_SUFFIX = ".format2"


def optim_file(tag: Path, *, tp_rank: int, pp_rank: int, dp_rank: int) -> Path:
    """The optimizer file of a (dp, tp, pp) rank in ``tag``."""
    return tag / optimizer_file(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)


def finish_interrupted_rewrites(root: Path) -> list[str]:
    """Complete the swap of an NxD-format rewrite (``--optimizer-format nxd``) that a stop interrupted.

    The rewrite replaces ``step_N`` by two renames (``step_N`` -> ``.step_N.format2``, then the complete
    ``.step_N.nxd-format`` -> ``step_N``); a stop between them leaves no ``step_N``, and ``--resume auto`` would
    silently go back to an older tag. Only a rewrite nxdtrain wrote (its run id in ckptconv.json) and that is
    complete (``done``) is put in place; then what is left of the replaced tag goes. Returns what was done."""
    said = []
    for staging in sorted(root.glob(f".step_*{NXD_REWRITE_SUFFIX}")):
        name = staging.name[1:-len(NXD_REWRITE_SUFFIX)]
        tag, replaced = root / name, root / f".{name}{REPLACED_SUFFIX}"
        if tag.exists() or not (staging / DONE_MARKER).is_file() or run_of(staging) is None:
            continue
        os.rename(staging, tag)
        said.append(f"{tag}: put in place its complete NxD-format rewrite {staging.name} (a stop came between the "
                    "two renames that replace a tag)")
        if replaced.is_dir() and run_of(replaced) == run_of(tag):
            remove_tag(replaced)
    return said


def run_of(tag: Path) -> str | None:
    """The id of the run that wrote ``tag`` (ckptconv.json ``extra.nxdtrain.run``); None: unknown (an older
    nxdtrain, another tool, no readable metadata)."""
    try:
        meta = read_metadata(tag)
    except ConversionError:
        return None
    extra = (meta.extra if meta is not None else None) or {}
    run = (extra.get(RECORD_KEY) or {}).get("run") if isinstance(extra.get(RECORD_KEY), dict) else None
    return run if isinstance(run, str) else None


def prune(root: Path, keep: int, *, run: str) -> list[Path]:
    """Delete all but the newest ``keep`` completed ``step_<N>`` tags of the run ``run``; return the deleted ones.

    Only tags that run wrote (its id in their ckptconv.json; a resume carries the id on) are counted and
    deleted: another run's tags in the same directory, and tags of unknown origin, are never touched.
    ``done`` goes first, so a crash halfway through a deletion leaves a tag that is never resumed.
    Only what nxdtrain wrote there goes (what its ckptconv.json lists, and the markers); a tag
    holding anything else keeps that, and its directory.
    """
    ours = [t for t in completed_tags(root) if is_step_tag(t.name) and run_of(t) == run]
    doomed = ours[:-keep] if len(ours) > keep else []
    for tag in doomed:
        remove_tag(tag)
    return doomed


def check_checkpoint_dir(directory: str | None, start_step: int) -> None:
    """Refuse a ``--checkpoint-dir`` this user cannot write, or that holds completed tags past this run's first step.

    Resuming that directory later would pick the other run's newer tag and silently drop this one's.
    """
    if not directory:
        return
    check_writable(directory, "--checkpoint-dir")
    if not Path(directory).is_dir():
        return
    if (Path(directory) / MODEL_DIR).is_dir():
        raise TrainError(f"--checkpoint-dir {directory}: holds NxD shards ({MODEL_DIR}/: a converted checkpoint or a "
                         f"tag); tags written there would sit behind those shards, and a requeued --resume {directory} "
                         f"would start again from them at step 0: use a directory of its own, e.g. "
                         f"{str(directory).rstrip('/')}-run")
    newer = [t.name for t in completed_tags(Path(directory)) if (tag_step(t.name) or 0) > start_step]
    if newer:
        raise TrainError(f"--checkpoint-dir {directory}: holds {newer[-1]}, past this run's start (step {start_step}); "
                         f"use an empty directory, or --resume {directory} to continue that run")


# --------------------------------------------------------------------------------------------
# One writer per checkpoint directory

RUN_LOCK = "nxdtrain-run"


def _busy(directory: str | Path, exc: outdir.BusyError) -> TrainError:
    holder = exc.holder
    since = f", started {holder['started']}" if holder.get("started") else ""
    return TrainError(f"--checkpoint-dir {directory}: another training run writes there "
                      f"({outdir.describe_holder(holder)}{since}); two runs in one directory would interleave "
                      "their tags: wait for it to end (or stop it), or use another --checkpoint-dir")


def check_one_writer(directory: str | None) -> None:
    """Refuse, before any process starts, a ``--checkpoint-dir`` that a live run holds (creates nothing)."""
    if directory and Path(directory).is_dir():
        try:
            outdir.check_free(Path(directory))
        except outdir.BusyError as exc:
            raise _busy(directory, exc) from None


def claim_checkpoint_dir(directory: str, command: str) -> outdir.OutLock:
    """Rank 0: hold ``--checkpoint-dir`` for the whole run (ckptconv's output lock: a flock the kernel drops
    when the process dies, even by SIGKILL, with an owner record naming pid, host, start and command)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    try:
        return outdir.acquire(path, fingerprint=RUN_LOCK, command=command)
    except outdir.BusyError as exc:
        raise _busy(directory, exc) from None
