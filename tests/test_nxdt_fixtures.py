"""The NxD training-checkpoint fixtures (fixtures/nxdt-official/) still match their manifests.

Every stored file has the size and sha256 its ``case.json`` records; every torch file still unpickles with
``torch.load(weights_only=True)`` (TensorReference allowed, via ``load_small``) into exactly the recorded key
list; every safetensors file has the recorded keys, dtypes and shapes; nothing is missing or extra.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckptconv.io.safe_load import load_small
from tests.conftest import fixture_cases
from tests.torch_rows import rows

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nxdt-official"
CASES = fixture_cases(FIXTURES)


def problems(case_dir: Path) -> list[str]:
    """Every way ``case_dir`` differs from its ``case.json``; empty when intact."""
    manifest = json.loads((case_dir / "case.json").read_text())
    found = []
    on_disk = {p.relative_to(case_dir).as_posix() for p in case_dir.rglob("*") if p.is_file()} - {"case.json"}
    listed = set(manifest["files"])
    found += [f"{rel}: not in the manifest" for rel in sorted(on_disk - listed)]
    found += [f"{rel}: missing" for rel in sorted(listed - on_disk)]
    for rel in sorted(listed & on_disk):
        entry, path = manifest["files"][rel], case_dir / rel
        data = path.read_bytes()
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            found.append(f"{rel}: sha256/size differ from the manifest")
        if entry["kind"] == "torch":
            got = json.loads(json.dumps(rows(load_small(path)), default=str))
            if got != entry["keys"]:
                found.append(f"{rel}: key list differs from the manifest")
        elif entry["kind"] == "safetensors":
            with safe_open(path, "pt") as f:
                got = [[k, str(f.get_slice(k).get_dtype()), list(f.get_slice(k).get_shape())] for k in f.keys()]
            if got != entry["keys"]:
                found.append(f"{rel}: safetensors keys differ from the manifest")
    # git keeps no empty directory: a listed one may be absent, but if present it must still be empty
    for rel in manifest["empty_dirs"]:
        path = case_dir / rel
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            found.append(f"{rel}: listed as an empty directory")
    for path in case_dir.rglob("*"):
        rel = path.relative_to(case_dir).as_posix()
        if path.is_dir() and not any(path.iterdir()) and rel not in manifest["empty_dirs"]:
            found.append(f"{rel}: empty directory not in the manifest")
    return found


def test_fixture_cases_exist() -> None:
    assert len(CASES) >= 11, CASES


@pytest.mark.parametrize("case", CASES)
def test_fixture_matches_manifest(case: str) -> None:
    assert problems(FIXTURES / case) == []


def test_damage_is_caught(tmp_path: Path) -> None:
    """A flipped byte, and a torch file re-saved without one key (its hash patched in), are both reported."""
    case = tmp_path / "case"
    shutil.copytree(FIXTURES / "zero1_bf16_masters", case)
    manifest = json.loads((case / "case.json").read_text())
    tensor_file = next(rel for rel, e in manifest["files"].items() if rel.startswith("ckpt/") and e["kind"] == "torch"
                       and "/optim/" in rel)
    model_file = next(rel for rel in manifest["files"] if "/model/" in rel)
    assert problems(case) == []

    raw = bytearray((case / tensor_file).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (case / tensor_file).write_bytes(bytes(raw))
    assert problems(case) == [f"{tensor_file}: sha256/size differ from the manifest"]

    shutil.copy(FIXTURES / "zero1_bf16_masters" / tensor_file, case / tensor_file)
    state = load_small(case / model_file)
    state.pop(next(iter(state)))
    torch.save(state, case / model_file)
    data = (case / model_file).read_bytes()
    manifest["files"][model_file].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (case / "case.json").write_text(json.dumps(manifest))
    assert problems(case) == [f"{model_file}: key list differs from the manifest"]
