"""Splitting one conversion over N processes, and finishing it once all of them are done.

Each process (``--part K/N``, or RANK/WORLD_SIZE from torchrun, or SLURM_PROCID/SLURM_NTASKS from
srun) writes a disjoint set of output files and records them in ``.ckptconv-tmp/part-K-of-N.json``.
Every process also writes the same ``finalize.json``: what remains to be written once all files
exist (config, index, copied tokenizer files, ``ckptconv.json``). The process that finishes last,
or ``ckptconv finalize OUT``, does that, so N processes produce exactly the files one would.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptconv.engine.launcher import detect_part, parse_part  # noqa: F401  (re-exported: where --part lived)
from ckptconv.engine.outdir import (
    TMP_DIR,
    BusyError,
    OutLock,
    acquire,
    check_free,
    copy_file,
    describe_holder,
    ensure_dir,
    last_holder,
    write_bytes,
    write_text,
)
from ckptconv.engine.tags import seal
from ckptconv.errors import ConversionError, UnfinishedOutput
from ckptconv.io.digest import DEFAULT, FileRecord
from ckptconv.io.metadata import METADATA_FILE, Metadata

if TYPE_CHECKING:
    from ckptconv.core.plan import Plan

SPEC_FILE = "finalize.json"


def assign_files(plan: Plan, part: tuple[int, int]) -> set[str]:
    """Files of ``part``: largest first to the least-loaded part; the same answer in every process."""
    return assign([(f.path, f.nbytes) for f in plan.files], part)


def assign(sizes: list[tuple[str, int]], part: tuple[int, int]) -> set[str]:
    """Of (path, bytes), the paths of ``part``: largest first to the least-loaded part; the same answer in
    every process."""
    k, n = part
    loads = [0] * n
    mine: set[str] = set()
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], i)):
        target = min(range(n), key=lambda p: (loads[p], p))
        loads[target] += sizes[index][1]
        if target == k:
            mine.add(sizes[index][0])
    return mine


@dataclass
class FinalizeSpec:
    """What to write after every part is done; JSON so ``ckptconv finalize`` can do it later."""

    fingerprint: str
    parts: int = 1
    hash: str | None = DEFAULT  # digest algorithm; None: sizes only
    metadata: dict[str, Any] | None = None        # Metadata fields except files; None: no ckptconv.json
    texts: dict[str, str] = field(default_factory=dict)         # relative path -> content
    blobs: dict[str, str] = field(default_factory=dict)         # relative path -> base64 of binary content
    copies: list[tuple[str, str]] = field(default_factory=list)  # (absolute source, relative target)
    markers: list[str] = field(default_factory=list)  # files holding "1", written after ckptconv.json (a tag's)


def _tmp(out: Path) -> Path:
    return out / TMP_DIR


def write_spec(out: Path, spec: FinalizeSpec) -> None:
    write_text(_tmp(out) / SPEC_FILE, json.dumps(asdict(spec), indent=1, sort_keys=True))


def state_name(part: tuple[int, int]) -> str:
    return f"state-{part[0]}-of-{part[1]}.json"


def record_part(out: Path, part: tuple[int, int], files: dict[str, FileRecord]) -> None:
    payload = {rel: rec.to_json() for rel, rec in files.items()}
    write_text(_tmp(out) / f"part-{part[0]}-of-{part[1]}.json", json.dumps(payload, indent=1))


def _read_spec(out: Path) -> FinalizeSpec:
    path = _tmp(out) / SPEC_FILE
    if not path.is_file():
        raise ConversionError(f"{out}: nothing to finalize (no {TMP_DIR}/{SPEC_FILE}; finished already, or never started)")
    try:
        data = json.loads(path.read_text())
        data["copies"] = [tuple(c) for c in data["copies"]]
        return FinalizeSpec(**data)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConversionError(f"{path}: not a ckptconv finalize spec ({exc}); rerun the conversion") from None


def pending_fingerprint(out: Path) -> str | None:
    """The fingerprint of an unfinished conversion in OUT's temporary directory, if any."""
    try:
        data = json.loads((_tmp(out) / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data.get("fingerprint") if isinstance(data, dict) else None


def refuse_unfinished(path: str | Path) -> None:
    """Raise :class:`UnfinishedOutput` when ``path`` is the OUT of a conversion that has not finished (its finalize
    spec written, its ``ckptconv.json`` not yet): interrupted, it names the command to rerun (its lock's record);
    still being written, the writer. Reading such a directory would only find files missing."""
    root = Path(path)
    if not root.is_dir() or (root / METADATA_FILE).exists() or pending_fingerprint(root) is None:
        return
    try:
        check_free(root)
    except BusyError as busy:
        raise UnfinishedOutput(f"{root}: a conversion is writing it now ({describe_holder(busy.holder)}); wait for "
                               "it to finish") from None
    command = str(last_holder(root).get("command") or "")
    command = command if " " in command else ""  # a command line with its arguments (not a bare `python -c`)
    raise UnfinishedOutput(f"{root}: an interrupted conversion (no {METADATA_FILE} yet; {TMP_DIR}/ holds its progress); "
                           f"rerun the same command to finish it{f' ({command})' if command else ''}: the files it "
                           "finished are kept")


def missing_parts(out: Path, spec: FinalizeSpec) -> list[int]:
    return [k for k in range(spec.parts) if not (_tmp(out) / f"part-{k}-of-{spec.parts}.json").is_file()]


def try_finalize(out: Path, lock: OutLock) -> dict[str, FileRecord] | None:
    """Finalize if every part is done and this process is the only one left holding OUT; else None.

    Parts share OUT's lock; the last to finish becomes its only holder, so exactly one finalizes,
    and a killed finalizer leaves no lock behind (the kernel drops a dead process's flock)."""
    if lock.shared and not lock.try_exclusive():
        return None  # siblings still running: the last of them finalizes
    spec = _read_spec(out)
    if missing_parts(out, spec):
        return None
    return _finalize(out, spec)


def finalize(out: str | Path) -> dict[str, FileRecord]:
    """``ckptconv finalize OUT``: finish a conversion whose parts are all done."""
    out = Path(out)
    if not (_tmp(out) / SPEC_FILE).is_file():
        _read_spec(out)  # the error: nothing to finalize
    with acquire(out, fingerprint="finalize", parts=1):
        spec = _read_spec(out)
        missing = missing_parts(out, spec)
        if missing:
            raise ConversionError(
                f"{out}: part(s) {', '.join(f'{k}/{spec.parts}' for k in missing)} not done yet; run them first"
            )
        return _finalize(out, spec)


def _finalize(out: Path, spec: FinalizeSpec) -> dict[str, FileRecord]:
    files: dict[str, FileRecord] = {}
    for k in range(spec.parts):
        part = json.loads((_tmp(out) / f"part-{k}-of-{spec.parts}.json").read_text())
        files.update({rel: FileRecord.from_json(rec) for rel, rec in part.items()})
    for rel, text in spec.texts.items():
        write_text(ensure_dir(out, str(Path(rel).parent)) / Path(rel).name, text)
    for rel, blob in spec.blobs.items():
        write_bytes(ensure_dir(out, str(Path(rel).parent)) / Path(rel).name, base64.b64decode(blob))
    for source, rel in spec.copies:
        copy_file(Path(source), ensure_dir(out, str(Path(rel).parent)) / Path(rel).name)
    for rel in [*spec.texts, *spec.blobs, *(rel for _, rel in spec.copies)]:
        files[rel] = FileRecord.of(out / rel, spec.hash)
    meta = (Metadata(**spec.metadata, files={rel: rec.to_json() for rel, rec in files.items()})
            if spec.metadata is not None else None)
    seal(out, meta, spec.markers)  # ckptconv.json, the markers (a tag's: ckptconv.engine.tags), tmp cleared
    return files
