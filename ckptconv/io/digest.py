"""What a written file was: its size and, unless asked not to, a cryptographic digest.

These records go into ``ckptconv.json`` as ``{"size": n, "<algorithm>": "<hex>"}``; reruns skip
files whose record still matches and ``verify --files`` checks them.

BLAKE3 is the default because it is a cryptographic hash that runs at ~4.5 GB/s on one core with
AVX2/AVX-512 (measured on the CI machine), faster than the disks we write to. sha256 stays
available for tools that expect it, but without SHA instructions it runs at ~0.4 GB/s per core:
there, hashing every output file takes longer than converting it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from ckptconv.errors import ConversionError

ALGORITHMS = ("blake3", "sha256")
DEFAULT = "blake3"
CHUNK = 256 * 2**10  # one reused buffer that stays in cache: ~30% less CPU than fresh 8 MiB reads


def check_algorithm(name: str | None) -> None:
    if name is not None and name not in ALGORITHMS:
        raise ConversionError(f"--hash must be one of {', '.join(ALGORITHMS)} or none, got {name!r}")


def new_hasher(algorithm: str) -> Any:
    """A fresh hasher of ``algorithm`` (both release the GIL, so threads hash in parallel). blake3's own threads
    only pay off for updates far larger than our bands, so it runs on the caller's thread."""
    check_algorithm(algorithm)
    return blake3.blake3() if algorithm == "blake3" else hashlib.sha256()


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of a file's bytes, read from disk."""
    digest = new_hasher(algorithm)
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return str(digest.hexdigest())


@dataclass(frozen=True)
class FileRecord:
    size: int
    algorithm: str | None = None  # None: the size alone was recorded (--hash none)
    digest: str | None = None

    @classmethod
    def of(cls, path: Path, algorithm: str | None, digest: str | None = None) -> FileRecord:
        """The record of the file at ``path``; ``digest``: its digest computed as it was written (else read)."""
        size = path.stat().st_size
        if not algorithm:
            return cls(size)
        return cls(size, algorithm, digest or file_digest(path, algorithm))

    def matches(self, path: Path) -> bool:
        """The file at ``path`` is still what was recorded (the digest is only computed when sizes agree)."""
        if not path.is_file() or path.stat().st_size != self.size:
            return False
        return self.algorithm is None or file_digest(path, self.algorithm) == self.digest

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size} | ({self.algorithm: self.digest} if self.algorithm else {})

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> FileRecord:
        """Read a record of any algorithm we know; ``{"sha256": null}`` (older --hash none) is size-only."""
        for algorithm in ALGORITHMS:
            if record.get(algorithm):
                return cls(int(record["size"]), algorithm, str(record[algorithm]))
        return cls(int(record["size"]))


def record_files(paths: list[Path], root: Path, algorithm: str | None,
                 known: Callable[[str], str | None] | None = None) -> dict[str, FileRecord]:
    """{path relative to ``root``: record} of the files among ``paths``, directories expanded
    (xser ``.tensors/``). ``known(relative path)``: a digest computed while the file was written, or None."""
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    records = {}
    for f in files:
        rel = f.relative_to(root).as_posix()
        records[rel] = FileRecord.of(f, algorithm, known(rel) if known is not None and algorithm else None)
    return records
