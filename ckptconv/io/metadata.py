"""``ckptconv.json``: what every directory we write says about itself.

It records the tool version, the HF config, the parallel layout, dtype, serialization flavour,
whether the embedding was tied, and a size and digest per file. Readers use it when present and
infer (saying what they inferred) when it is absent.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptconv.errors import ConversionError
from ckptconv.io.atomic import write_text

METADATA_FILE = "ckptconv.json"
FORMAT_VERSION = 1


def tool_version() -> str:
    """The installed package's version (``ckptconv.__version__``, which the package metadata is built from;
    read without importlib.metadata, whose import alone costs the CLIs ~0.1 s of start-up)."""
    from ckptconv.hall import __version__

    return __version__


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """``--version``: prints ``PROG VERSION``; the version is looked up only when the flag is given."""

    class _Version(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
            print(f"{parser.prog} {tool_version()}")  # on stdout, as argparse's own version action
            parser.exit()

    parser.add_argument("--version", action=_Version, nargs=0, default=argparse.SUPPRESS,
                        help="print the version and exit")


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

    return write_text(directory / METADATA_FILE, json.dumps(meta.to_json(), indent=1) + "\n")


def read_metadata(directory: Path) -> Metadata | None:
    path = directory / METADATA_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("tool") != "ckptconv" or not isinstance(data.get("files"), dict):
        raise ConversionError(f"{path}: not a ckptconv metadata file (needs tool 'ckptconv' and 'files')")
    _check_types(path, data)
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


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "kind": (str,), "hf_config": (dict, type(None)), "layout": (dict, type(None)), "flavour": (str, type(None)),
    "dtype": (str, type(None)), "fingerprint": (str,), "extra": (dict, type(None)), "format_version": (int,),
}


def _check_types(path: Path, data: dict[str, Any]) -> None:
    """Every field has the JSON type we write (a hand-edited or hostile file fails here, in one line)."""
    if "kind" not in data:
        raise ConversionError(f"{path}: missing 'kind'")
    for key, kinds in _FIELD_TYPES.items():
        if key in data and not isinstance(data[key], kinds):
            names = " or ".join("null" if k is type(None) else {"str": "string", "dict": "object", "int": "integer"}[k.__name__] for k in kinds)
            raise ConversionError(f"{path}: {key!r} must be {names}, got {type(data[key]).__name__}")
    for rel, record in data["files"].items():
        if not isinstance(record, dict) or type(record.get("size")) is not int:
            raise ConversionError(f"{path}: files[{rel!r}] must be an object with an integer 'size', got {record!r}")
