"""Splitting one conversion over N processes, and finishing it once all of them are done.

Each process (``--part K/N``, or RANK/WORLD_SIZE from torchrun, or SLURM_PROCID/SLURM_NTASKS from
srun) writes a disjoint set of output files and records them in ``.ckptconv-tmp/part-K-of-N.json``.
Every process also writes the same ``finalize.json``: what remains to be written once all files
exist (config, index, copied tokenizer files, ``ckptconv.json``). The process that finishes last,
or ``ckptconv finalize OUT``, does that, so N processes produce exactly the files one would.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptconv.digest import DEFAULT, FileRecord
from ckptconv.errors import ConversionError
from ckptconv.execute import TMP_DIR
from ckptconv.metadata import Metadata, write_metadata
from ckptconv.plan import Plan

SPEC_FILE = "finalize.json"
LOCK_FILE = "finalize.lock"


def parse_part(text: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N) with 0 <= K < N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConversionError(f"--part must look like K/N (e.g. 0/4), got {text!r}") from None
    if not 0 <= k < n:
        raise ConversionError(f"--part {text}: need 0 <= K < N")
    return k, n


def detect_part(explicit: tuple[int, int] | None = None) -> tuple[int, int]:
    """This process's part: explicit, else from srun or torchrun, else the whole job."""
    if explicit is not None:
        return explicit
    for rank_var, size_var in (("SLURM_PROCID", "SLURM_NTASKS"), ("RANK", "WORLD_SIZE")):
        size = os.environ.get(size_var)
        if size and int(size) > 1:
            return int(os.environ.get(rank_var, "0")), int(size)
    return 0, 1


def assign_files(plan: Plan, part: tuple[int, int]) -> set[str]:
    """Files of ``part``: largest first to the least-loaded part; the same answer in every process."""
    k, n = part
    loads = [0] * n
    mine: set[str] = set()
    for index in sorted(range(len(plan.files)), key=lambda i: (-plan.files[i].nbytes, i)):
        target = min(range(n), key=lambda p: (loads[p], p))
        loads[target] += plan.files[index].nbytes
        if target == k:
            mine.add(plan.files[index].path)
    return mine


@dataclass
class FinalizeSpec:
    """What to write after every part is done; JSON so ``ckptconv finalize`` can do it later."""

    fingerprint: str
    parts: int = 1
    hash: str | None = DEFAULT  # digest algorithm; None: sizes only
    metadata: dict[str, Any] | None = None        # Metadata fields except files; None: no ckptconv.json
    texts: dict[str, str] = field(default_factory=dict)         # relative path -> content
    copies: list[tuple[str, str]] = field(default_factory=list)  # (absolute source, relative target)


def _tmp(out: Path) -> Path:
    return out / TMP_DIR


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_spec(out: Path, spec: FinalizeSpec) -> None:
    _atomic_write(_tmp(out) / SPEC_FILE, json.dumps(asdict(spec), indent=1, sort_keys=True))


def state_name(part: tuple[int, int]) -> str:
    return f"state-{part[0]}-of-{part[1]}.json"


def record_part(out: Path, part: tuple[int, int], files: dict[str, FileRecord]) -> None:
    payload = {rel: rec.to_json() for rel, rec in files.items()}
    _atomic_write(_tmp(out) / f"part-{part[0]}-of-{part[1]}.json", json.dumps(payload, indent=1))


def _read_spec(out: Path) -> FinalizeSpec:
    path = _tmp(out) / SPEC_FILE
    if not path.is_file():
        raise ConversionError(f"{out}: nothing to finalize (no {TMP_DIR}/{SPEC_FILE}; finished already, or never started)")
    data = json.loads(path.read_text())
    data["copies"] = [tuple(c) for c in data["copies"]]
    return FinalizeSpec(**data)


def missing_parts(out: Path, spec: FinalizeSpec) -> list[int]:
    return [k for k in range(spec.parts) if not (_tmp(out) / f"part-{k}-of-{spec.parts}.json").is_file()]


def try_finalize(out: Path) -> dict[str, FileRecord] | None:
    """Finalize if every part is done and no other process is at it; else None."""
    spec = _read_spec(out)
    if missing_parts(out, spec):
        return None
    try:
        lock = os.open(_tmp(out) / LOCK_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return None  # another part finished at the same moment and is finalizing
    os.close(lock)
    return _finalize(out, spec)


def finalize(out: str | Path) -> dict[str, FileRecord]:
    """``ckptconv finalize OUT``: finish a conversion whose parts are all done."""
    out = Path(out)
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
        _atomic_write(out / rel, text)
    for source, rel in spec.copies:
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        shutil.copyfile(source, partial)
        os.replace(partial, target)
    for rel in [*spec.texts, *(rel for _, rel in spec.copies)]:
        files[rel] = FileRecord.of(out / rel, spec.hash)
    if spec.metadata is not None:
        meta = Metadata(**spec.metadata, files={rel: rec.to_json() for rel, rec in files.items()})
        write_metadata(out, meta)  # last: its presence means the directory is complete
    shutil.rmtree(_tmp(out), ignore_errors=True)
    return files
