"""The executor's resume state: ``.ckptconv-tmp/state.json``, the files written so far with their records, kept only
while the conversion's fingerprint matches."""

from __future__ import annotations

import json
from pathlib import Path

from ckptconv.io.atomic import write_text
from ckptconv.io.digest import FileRecord


def load_state(path: Path, fingerprint: str) -> dict[str, dict[str, FileRecord]]:
    """{planned file: {written file: record}} of an earlier run of the same conversion, else {}."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    if data.get("fingerprint") != fingerprint:
        return {}
    return {
        path: {member: FileRecord.from_json(rec) for member, rec in members.items()}
        for path, members in data.get("files", {}).items()
    }


def save_state(path: Path, fingerprint: str, state: dict[str, dict[str, FileRecord]]) -> None:
    files = {name: {m: r.to_json() for m, r in members.items()} for name, members in state.items()}
    payload = {"fingerprint": fingerprint, "files": files}
    write_text(path, json.dumps(payload, indent=1))
