"""``ckptconv.json``: what every directory we write says about itself.

It records the tool version, the HF config, the parallel layout, dtype, serialization flavour,
whether the embedding was tied, and a size and digest per file. Readers use it when present and
infer (saying what they inferred) when it is absent.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from ckptconv.errors import ConversionError

METADATA_FILE = "ckptconv.json"
FORMAT_VERSION = 1


def tool_version() -> str:
    try:
        return importlib_metadata.version("ckptconv")
    except importlib_metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(kw_only=True)
class Metadata:
    kind: str                                  # "nxd" or "hf"
    hf_config: dict[str, Any]
    files: dict[str, dict[str, Any]]           # relative path -> {"size": int, "blake3"/"sha256": hex}
    layout: dict[str, Any] | None = None       # ParallelLayout.to_json(), for kind "nxd"
    flavour: str | None = None
    dtype: str | None = None
    with_inv_freq: bool = False
    fingerprint: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    version: str = field(default_factory=tool_version)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": "ckptconv",
            "version": self.version,
            "format_version": self.format_version,
            "kind": self.kind,
            "layout": self.layout,
            "flavour": self.flavour,
            "dtype": self.dtype,
            "with_inv_freq": self.with_inv_freq,
            "fingerprint": self.fingerprint,
            "hf_config": self.hf_config,
            "extra": self.extra,
            "files": dict(sorted(self.files.items())),
        }


def write_metadata(directory: Path, meta: Metadata) -> Path:
    """Write ``ckptconv.json`` atomically (it is written last: its presence means complete)."""
    target = directory / METADATA_FILE
    partial = directory / (METADATA_FILE + ".partial")
    partial.write_text(json.dumps(meta.to_json(), indent=1) + "\n")
    os.replace(partial, target)
    return target


def read_metadata(directory: Path) -> Metadata | None:
    path = directory / METADATA_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if data.get("tool") != "ckptconv" or not isinstance(data.get("files"), dict):
        raise ConversionError(f"{path}: not a ckptconv metadata file (needs tool 'ckptconv' and 'files')")
    if data.get("format_version", 0) > FORMAT_VERSION:
        raise ConversionError(
            f"{path}: format_version {data['format_version']} is newer than this ckptconv understands "
            f"({FORMAT_VERSION}); upgrade ckptconv"
        )
    return Metadata(
        kind=data["kind"],
        hf_config=data.get("hf_config") or {},
        files=data["files"],
        layout=data.get("layout"),
        flavour=data.get("flavour"),
        dtype=data.get("dtype"),
        with_inv_freq=bool(data.get("with_inv_freq")),
        fingerprint=data.get("fingerprint", ""),
        extra=data.get("extra") or {},
        version=data.get("version", "?"),
        format_version=data.get("format_version", FORMAT_VERSION),
    )
