"""The key list of a torch file, one row per leaf: the form of ``case.json`` -> ``files`` -> ``keys``.

Shared by the fixture-manifest check (``test_nxdt_fixtures``), the proof that NxD's loader resumes what our writer
writes (``test_nxd_written_proof``) and ``tools/nxd_check`` (which records that proof).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ckptconv.io.safe_load import TensorReference

_PRIMITIVE = (int, float, bool, str, type(None))


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's element bytes (C order): what it holds, not how ``torch.save`` framed it (a file's
    bytes also carry a random ``serialization_id``)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def rows(obj: Any, path: tuple = (), *, digests: bool = False) -> list:
    """``[path, kind, dtype, shape-or-value]`` for every leaf, in the object's own order (the manifest's form);
    with ``digests`` every tensor row gets a fifth entry, ``tensor_sha256`` of its values."""
    if isinstance(obj, torch.Tensor):
        row = [list(path), "tensor", str(obj.dtype).removeprefix("torch."), list(obj.shape)]
        return [row + [tensor_sha256(obj)] if digests else row]
    if isinstance(obj, TensorReference):
        return [[list(path), "TensorReference", None, obj.tid]]
    if isinstance(obj, dict):
        if not obj:
            return [[list(path), "dict", None, 0]]
        return [r for k, v in obj.items() for r in rows(v, path + (k,), digests=digests)]
    if isinstance(obj, torch.Size):
        return [[list(path), "torch.Size", None, list(obj)]]
    if isinstance(obj, (list, tuple)):
        if all(isinstance(x, _PRIMITIVE) for x in obj):
            return [[list(path), type(obj).__name__, None, list(obj)]]
        return [r for i, v in enumerate(obj) for r in rows(v, path + (i,), digests=digests)]
    if isinstance(obj, torch.dtype):
        return [[list(path), "torch.dtype", None, str(obj)]]
    return [[list(path), type(obj).__name__, None, obj if isinstance(obj, _PRIMITIVE) else repr(obj)]]


# ckptconv's own record of what it wrote; NxD never reads it, and it names paths and times
NOT_READ_BY_NXD = ("ckptconv.json",)


def tag_tree(tag_dir: Path) -> dict[str, dict[str, Any]]:
    """Every file of a tag by relative path: a torch file's ``rows`` with tensor digests, a text file's text.

    What NxD's loader reads, compared by content (``torch.save`` writes a random ``serialization_id`` into every
    file, so equal content does not mean equal bytes). Files in ``NOT_READ_BY_NXD`` are left out.
    """
    from ckptconv.io.safe_load import load_small

    tree: dict[str, dict[str, Any]] = {}
    for path in sorted(tag_dir.rglob("*")):
        rel = path.relative_to(tag_dir).as_posix()
        if path.is_dir():
            if not any(path.iterdir()):
                tree[rel] = {"kind": "empty dir"}
            continue
        if rel in NOT_READ_BY_NXD:
            continue
        data = path.read_bytes()
        if data.startswith(b"PK"):  # torch.save's zip format
            tree[rel] = {"kind": "torch", "keys": json.loads(json.dumps(rows(load_small(path), digests=True)))}
        else:
            tree[rel] = {"kind": "text", "text": data.decode()}
    return tree


def first_difference(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> str | None:
    """The first way two ``tag_tree`` results differ, as one line (file, key, expected, actual); None if equal."""
    for rel in sorted(set(got) | set(want)):
        if rel not in got or rel not in want:
            return f"{rel}: {'missing' if rel not in got else 'not in the manifest'}"
        g, w = got[rel], want[rel]
        if g.get("kind") != w.get("kind") or g.get("text") != w.get("text"):
            return f"{rel}: expected {w}, got {g}"
        g_keys, w_keys = g.get("keys", []), w.get("keys", [])
        for g_row, w_row in zip(g_keys, w_keys, strict=False):  # lengths compared below
            if g_row != w_row:
                return f"{rel} key {w_row[0]}: expected {w_row[1:]}, got {g_row[1:]} (at key {g_row[0]})"
        if len(g_keys) != len(w_keys):
            return f"{rel}: expected {len(w_keys)} leaves, got {len(g_keys)}"
    return None
