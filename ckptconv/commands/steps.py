"""The steps every conversion shares: write a plan under OUT's lock and finalize it, fingerprints, OUT's
ownership, and the HF config a converted checkpoint records. Used by :mod:`ckptconv.commands.api` and
:mod:`ckptconv.commands.dcp`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptconv.core.layout import HF_FILES_DIR
from ckptconv.core.plan import NESTED_TORCH, Plan
from ckptconv.engine import outdir
from ckptconv.engine.execute import ExecOptions, run_plan
from ckptconv.engine.finalize import (
    FinalizeSpec,
    assign_files,
    pending_fingerprint,
    record_part,
    state_name,
    try_finalize,
    write_spec,
)
from ckptconv.engine.options import RunOptions
from ckptconv.engine.progress import byte_progress
from ckptconv.errors import ConversionError
from ckptconv.io.digest import FileRecord
from ckptconv.io.hf import CONFIG, config_text
from ckptconv.io.metadata import read_metadata, tool_version
from ckptconv.io.nxd import TENSORS_SUFFIX
from ckptconv.sources.masters import MasterWeights
from ckptconv.training.nxd_optimizer import OPTIM_DIR
from ckptconv.training.tag_parts import TagPart


@dataclass
class Result:
    out: Path
    files: dict[str, FileRecord]
    bytes_written: int
    seconds: float
    notes: list[str]
    layout: dict[str, Any] | None = None
    skipped: bool = False
    finalized: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "files": len(self.files),
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "layout": self.layout,
            "notes": self.notes,
            "up_to_date": self.skipped,
            "complete": self.finalized,
        }




def _convert(plan: Plan, reader: Any, out: Path, sinks: Any, options: RunOptions, spec: FinalizeSpec,
             label: str, kv_replicas: str = "error", *, sources: list[Path], part_of: TagPart | None = None) -> Result:
    """Write this process's part of ``plan`` under OUT's lock; finalize when it is the last part to finish.
    ``part_of``: a training tag's part, whose ``plan`` holds its own files only (:mod:`ckptconv.training.tag_parts`)."""
    part = options.part
    spec.parts = part[1]
    spec.hash = options.digest
    if part[1] > 1 and options.overwrite:
        raise ConversionError("--overwrite cannot be combined with several parts; run without --part first")
    outdir.check_separate(sources, out)
    with outdir.acquire(out, fingerprint=spec.fingerprint, parts=part[1]) as lock:
        if not lock.shared:  # the first (or only) process: check OUT and set it up
            if _up_to_date(out, spec.fingerprint, options):
                outdir.clear_tmp(out)  # what a run killed after writing ckptconv.json left behind
                return Result(out, _recorded(out), 0, 0.0, ["output is up to date"], skipped=True)
            _prepare_out(out, spec.fingerprint, options)
            outdir.declare(out, spec.fingerprint[:16], _outputs(plan, spec) if part_of is None else list(part_of.declared))
            write_spec(out, spec)
            if part[1] > 1:
                lock.share()
        mine = assign_files(plan, part) if part_of is None else set(part_of.mine)
        total = sum(f.nbytes for f in plan.files if f.path in mine)
        with byte_progress(f"{label} {out.name}", total, quiet=options.quiet) as advance:
            exec_options = ExecOptions(workers=options.workers, max_memory=options.max_memory, replicas=kv_replicas,
                                       fingerprint=spec.fingerprint, hash=spec.hash, progress=advance)
            files = run_plan(plan, reader, out, sinks, exec_options, only_files=mine, state_file=state_name(part))
        if hasattr(reader, "finish_checks"):  # every input file read from matches its record, before OUT is complete
            reader.finish_checks(workers=options.workers)
        record_part(out, part, files)
        finalized = try_finalize(out, lock)
    count = len(plan.files) if part_of is None else part_of.count
    notes = [] if part[1] == 1 else [f"part {part[0]}/{part[1]}: {len(mine)} of {count} files"]
    if finalized is None:
        notes.append(f"other parts are still running; the last one (or `ckptconv finalize {out}`) finishes OUT")
    return Result(out, finalized or files, total, 0.0, notes, finalized=finalized is not None)


def _outputs(plan: Plan, spec: FinalizeSpec) -> list[str]:
    """Every path this conversion may create in OUT (declared before the first byte is written)."""
    paths = [f.path for f in plan.files] + [f.path + TENSORS_SUFFIX for f in plan.files
                                            if f.format in ("torch", NESTED_TORCH)]
    return paths + list(spec.texts) + list(spec.blobs) + [rel for _, rel in spec.copies] + spec.markers


def _input_files(ckpt: Any) -> list[Path]:
    """The files a conversion of ``ckpt`` reads: its model shards, and the optimizer files when the
    weights are NxD's masters (so that an output is never "up to date" with other inputs)."""
    files = sorted(ckpt.files.values())
    if isinstance(ckpt.weight_source, MasterWeights):  # nxdtrain's masters: named apart (ckpt.masters_identity)
        files += sorted(p for p in (ckpt.root / OPTIM_DIR).rglob("*") if p.is_file())
    return files


def _identity(files: list[Path]) -> list[tuple[str, int, int]]:
    """What identifies the inputs cheaply: names, sizes, modification times."""
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def _fingerprint(*parts: Any) -> str:
    payload = json.dumps([tool_version(), *parts], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def _up_to_date(out: Path, fingerprint: str, options: RunOptions) -> bool:
    meta = read_metadata(out) if out.is_dir() else None
    if meta is None or meta.fingerprint != fingerprint or options.overwrite:
        return False
    return all(FileRecord.from_json(rec).matches(out / rel) for rel, rec in meta.files.items())


def _recorded(out: Path) -> dict[str, FileRecord]:
    meta = read_metadata(out)
    assert meta is not None
    return {rel: FileRecord.from_json(rec) for rel, rec in meta.files.items()}


def _prepare_out(out: Path, fingerprint: str, options: RunOptions) -> None:
    """Under OUT's lock: resume this conversion, or start it in an empty OUT, or (``--overwrite``)
    replace an earlier ckptconv conversion. Never removes what no ckptconv writer recorded."""
    meta = read_metadata(out) if out.is_dir() else None
    if meta is not None and meta.fingerprint == fingerprint:
        return  # same conversion, some files damaged or missing: redo those
    if meta is None and pending_fingerprint(out) == fingerprint:
        return  # an interrupted run of this same conversion (or another part of it): resume
    strangers, ours = outdir.foreign(out), outdir.present(out)
    if strangers and options.overwrite:
        raise ConversionError(
            f"{out}: --overwrite only replaces files a ckptconv conversion recorded; {strangers[0]!r} is not one of "
            "them; choose another OUT (or move that file away yourself)"
        )
    if (strangers or ours) and not options.overwrite:
        what = (f"another conversion ({meta.kind}, fingerprint {meta.fingerprint[:12]})" if meta is not None
                else "files of an unfinished conversion" if ours else f"files ckptconv did not write ({strangers[0]!r})")
        raise ConversionError(f"{out}: not empty; holds {what}; choose another OUT")
    outdir.remove_owned(out)  # only ours: listed in ckptconv.json or declared in the temporary directory


def _config_as_written(config: dict[str, Any], dtype: str, plan: Plan, copies: list[tuple[str, str]]
                       ) -> tuple[dict[str, Any], list[tuple[str, str]], dict[str, str]]:
    """(HF config to record, side-file copies, texts) of a converted checkpoint: after a deliberate
    ``--dtype`` cast the written dtype becomes the model's, in ckptconv.json and in the kept
    ``hf/config.json`` (so ``to-hf --dtype source`` keeps it); otherwise all as they were."""
    name = _dtype_name(plan)
    if dtype == "keep" or "," in name:
        return config, copies, {}
    config = {**config, "torch_dtype": name, "dtype": name}
    kept = f"{HF_FILES_DIR}/{CONFIG}"
    return config, [c for c in copies if c[1] != kept], {kept: config_text(config, plan.files[0].tensors[0].dtype)}


def _dtype_name(plan: Plan) -> str:
    names = sorted({str(t.dtype).removeprefix("torch.") for f in plan.files for t in f.tensors
                    if not t.key.endswith("inv_freq")})
    return names[0] if len(names) == 1 else ",".join(names)
