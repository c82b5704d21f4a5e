"""The official converter's golden outputs (fixtures/nxd-official/) still match their manifests.

Every data file of a case has the sha256 its ``case.json`` records; no recorded file is missing and no file is
there that the manifest does not record; a directory listed in ``empty_dirs`` (git keeps none) is absent or empty.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import GOLDEN, fixture_cases

CASES = fixture_cases(GOLDEN)
EXPECTED_CASES = [
    "gqa_tp1_pp2_vpp2_trn1", "gqa_tp2_pp1_kvm1_trn1", "gqa_tp2_pp1_trn2_fused", "gqa_tp2_pp2_vpp2_trn1",
    "gqa_tp4_pp2_kvm2_fused_xser_trn1", "mha_tp2_pp2_coalesce",
]


def problems(case_dir: Path) -> list[str]:
    """Every way ``case_dir`` differs from its ``case.json``; empty when intact."""
    manifest = json.loads((case_dir / "case.json").read_text())
    recorded: dict[str, str] = manifest["sha256"]
    on_disk = {p.relative_to(case_dir).as_posix() for p in case_dir.rglob("*") if p.is_file()} - {"case.json"}
    found = [f"{rel}: not in case.json's sha256" for rel in sorted(on_disk - set(recorded))]
    found += [f"{rel}: missing" for rel in sorted(set(recorded) - on_disk)]
    for rel in sorted(set(recorded) & on_disk):
        if hashlib.sha256((case_dir / rel).read_bytes()).hexdigest() != recorded[rel]:
            found.append(f"{rel}: sha256 differs from case.json")
    found += [f"{rel}: an output without a sha256" for rel in manifest["outputs"] if rel not in recorded]
    for rel in manifest["empty_dirs"]:
        path = case_dir / rel
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            found.append(f"{rel}: listed as an empty directory")
    return found


def test_the_six_cases_are_there() -> None:
    assert CASES == EXPECTED_CASES


@pytest.mark.parametrize("case", CASES)
def test_golden_case_matches_its_sha256(case: str) -> None:
    manifest = json.loads((GOLDEN / case / "case.json").read_text())
    # every input and every output is hashed: the official shards and (where recorded) the full-state file
    assert set(manifest["inputs"]) <= set(manifest["sha256"])
    assert len(manifest["sha256"]) >= len(manifest["inputs"]) + len(manifest["outputs"])
    assert problems(GOLDEN / case) == []


def test_damage_is_caught(tmp_path: Path) -> None:
    """A flipped byte, a removed shard, an extra file and a filled empty dir are each reported."""
    name = "gqa_tp4_pp2_kvm2_fused_xser_trn1"
    case = shutil.copytree(GOLDEN / name, tmp_path / name)
    assert problems(case) == []
    shard = case / "out/model/dp_rank_00_tp_rank_01_pp_rank_00.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    (case / "out/model/dp_rank_00_tp_rank_03_pp_rank_01.pt").unlink()
    (case / "stray.pt").write_bytes(b"x")
    tensors = case / "out/model/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors"
    tensors.mkdir()
    (tensors / "tensor_0.pt").write_bytes(b"y")
    assert problems(case) == [
        "out/model/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors/tensor_0.pt: not in case.json's sha256",
        "stray.pt: not in case.json's sha256",
        "out/model/dp_rank_00_tp_rank_03_pp_rank_01.pt: missing",
        "out/model/dp_rank_00_tp_rank_01_pp_rank_00.pt: sha256 differs from case.json",
        "out/model/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors: listed as an empty directory",
    ]


def test_a_missing_fixture_folder_fails_naming_it(tmp_path: Path) -> None:
    """No skip: a missing folder (or one without cases) is a failure whose message names the path."""
    gone = tmp_path / "gone"
    with pytest.raises(pytest.fail.Exception, match=re.escape(f"fixture folder missing or without any case.json: {gone}")):
        fixture_cases(tmp_path / "gone")
    (tmp_path / "empty").mkdir()
    with pytest.raises(pytest.fail.Exception, match="without any case.json"):
        fixture_cases(tmp_path / "empty")
    (tmp_path / "one" / "c").mkdir(parents=True)
    (tmp_path / "one" / "c" / "case.json").write_text("{}")
    assert fixture_cases(tmp_path / "one") == ["c"]
