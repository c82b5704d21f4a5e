"""File records: what ckptconv.json says about each file, in every form we have written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import blake3
import pytest

from ckptconv.errors import ConversionError
from ckptconv.io.digest import FileRecord, file_digest


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "shard.pt"
    path.write_bytes(bytes(range(256)) * 70_001)  # spans several read chunks, not a multiple of one
    return path


def test_digests_match_the_reference_libraries(data_file: Path):
    data = data_file.read_bytes()
    assert file_digest(data_file, "blake3") == blake3.blake3(data).hexdigest()
    assert file_digest(data_file, "sha256") == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("algorithm", ["blake3", "sha256", None])
def test_record_round_trips_through_json_and_detects_changes(data_file: Path, algorithm: str | None):
    record = FileRecord.from_json(FileRecord.of(data_file, algorithm).to_json())
    assert record == FileRecord.of(data_file, algorithm) and record.matches(data_file)
    data = bytearray(data_file.read_bytes())
    data[12345] ^= 1
    data_file.write_bytes(bytes(data))
    assert record.matches(data_file) is (algorithm is None), "a flipped byte is caught whenever a digest was kept"
    data_file.write_bytes(bytes(data[:-1]))
    assert not record.matches(data_file), "a size change is caught even without a digest"
    data_file.unlink()
    assert not record.matches(data_file)


def test_records_written_by_earlier_versions_still_read(data_file: Path):
    sha = hashlib.sha256(data_file.read_bytes()).hexdigest()
    size = data_file.stat().st_size
    assert FileRecord.from_json({"size": size, "sha256": sha}) == FileRecord(size, "sha256", sha)
    assert FileRecord.from_json({"size": size, "sha256": None}) == FileRecord(size)  # old --hash none


def test_unknown_algorithm_is_refused(data_file: Path):
    with pytest.raises(ConversionError, match="--hash must be one of blake3, sha256 or none, got 'md5'"):
        file_digest(data_file, "md5")
