"""Checked reads: a damaged or misplaced shard fails every command that reads it, with one line naming it."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import threading
from pathlib import Path

import blake3
import pytest
import torch

import ckptconv
from ckptconv.cli.main import main
from ckptconv.commands.inspect import inspect
from ckptconv.errors import IntegrityError
from ckptconv.io.checked import SMALL_GAP, StreamCheck, ZipCrc
from ckptconv.io.crc import crc32
from ckptconv.io.digest import FileRecord
from ckptconv.io.nxd_read import NxdCheckpoint
from ckptconv.io.torchzip_read import TorchZipReader
from tests.conftest import hf_state

QUIET = ckptconv.RunOptions(quiet=True, workers=2)
SHARD = "model/dp_rank_00_tp_rank_{:02d}_pp_rank_{:02d}.pt"
GQA = dict(heads=8, kv_heads=2, head_dim=8, layers=4)
CRC_ERROR = (r"ckptconv: error: {path}: record {record} has CRC-32 [0-9a-f]{{8}}, the zip directory records "
             r"[0-9a-f]{{8}}; the file is corrupt \(pass --no-check to read it anyway\)\n")


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    """(HF source, its tp 2 x pp 2 NxD conversion with ckptconv.json)."""
    hf = tiny_models("checked-gqa", **GQA)
    out = tmp_path_factory.mktemp("checked") / "nxd"
    ckptconv.to_nxd(hf, out, tp=2, pp=2, attention="qkv_linear", options=QUIET)
    return hf, out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def record_of(path: Path, key: str) -> tuple[str, int]:
    """(zip record name, file offset of its data) of tensor ``key``."""
    with TorchZipReader(path) as reader:
        entry = reader.entry(key)
        name = next(e.name for e in reader._zip.values() if reader._data_offset(e) == entry.data_offset)
        return name, entry.data_offset


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


KEY = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture
def flipped(converted, tmp_path) -> tuple[Path, Path, Path, str]:
    """A copy of the conversion with one flipped byte inside a tensor of tp 1 pp 0; (hf, nxd, file, record)."""
    hf, src = converted
    nxd = copy(src, tmp_path / "nxd")
    path = nxd / SHARD.format(1, 0)
    record, offset = record_of(path, KEY)
    flip(path, offset + 100)
    return hf, nxd, path, record


def test_flipped_byte_fails_every_reading_command(flipped, tmp_path, capsys):
    hf, nxd, path, record = flipped
    expected = CRC_ERROR.format(path=re.escape(str(path)), record=re.escape(record))
    commands = {
        "to-hf": ["to-hf", str(nxd), str(tmp_path / "hf-out"), "--quiet"],
        "reshard": ["reshard", str(nxd), str(tmp_path / "resharded"), "--tp", "1", "--pp", "1", "--quiet"],
        "verify": ["verify", str(hf), str(nxd), "--layers", "all"],
        "inspect": ["inspect", str(nxd)],
    }
    for name, argv in commands.items():
        code, err = run(argv, capsys)
        assert code == 1, name
        assert re.fullmatch(expected, err), (name, err)
    for out in ("hf-out", "resharded"):  # nothing that looks complete
        assert not (tmp_path / out / "ckptconv.json").exists()


def test_no_check_reads_the_damaged_file(flipped, converted, tmp_path, capsys):
    hf, nxd, path, _ = flipped
    code, _ = run(["to-hf", str(nxd), str(tmp_path / "forensic"), "--quiet", "--no-check"], capsys)
    assert code == 0
    exported, original = hf_state(tmp_path / "forensic"), hf_state(hf)
    differ = [k for k in original if not torch.equal(exported[k], original[k])]
    assert differ == [KEY]  # exactly the damaged tensor came through, one element changed
    assert int((exported[KEY] != original[KEY]).sum()) == 1
    code, _ = run(["inspect", str(nxd), "--json", "--no-check"], capsys)
    assert code == 0
    report = inspect(nxd, check=False)
    assert report["complete"] is True and report["checked_files"] == 0  # sizes only: documented
    assert inspect(converted[1])["checked_files"] == 4  # the intact one: every shard hashed


def test_digest_mismatch_outside_any_record(converted, tmp_path):
    """A byte outside every record's data (a local header's padding) passes the CRCs; the digest catches it."""
    _, src = converted
    nxd = copy(src, tmp_path / "nxd")
    path = nxd / SHARD.format(0, 1)
    _, offset = record_of(path, "lm_head.weight")
    data = path.read_bytes()
    assert data[offset - 1:offset] == b"Z"  # torch's alignment padding, part of no record
    flip(path, offset - 1)
    actual = blake3.blake3(path.read_bytes()).hexdigest()
    recorded = json.loads((nxd / "ckptconv.json").read_text())["files"][SHARD.format(0, 1)]["blake3"]
    with pytest.raises(IntegrityError) as info:  # refused: no word of the tokenizer of an export never written
        ckptconv.to_hf(nxd, tmp_path / "out", options=QUIET)
    assert str(info.value) == (f"{path}: blake3 {actual}, ckptconv.json records {recorded}; the file changed after it "
                               "was written, or is another rank's shard (pass --no-check to read it anyway)")
    assert not (tmp_path / "out" / "ckptconv.json").exists()


def test_size_mismatch_fails_at_open(converted, tmp_path):
    _, src = converted
    nxd = copy(src, tmp_path / "nxd")
    path = nxd / SHARD.format(1, 1)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(IntegrityError, match=re.escape(f"{path}: {size + 1} bytes, ckptconv.json records {size}; "
                                                       "the file was truncated or replaced")):
        NxdCheckpoint(nxd)
    NxdCheckpoint(nxd, check=False).close()


@pytest.mark.parametrize("metadata", [True, False])
def test_swapped_tp_rank_files_are_caught(converted, tmp_path, capsys, metadata):
    hf, src = converted
    nxd = copy(src, tmp_path / "nxd")
    a, b = nxd / SHARD.format(0, 0), nxd / SHARD.format(1, 0)
    os.rename(a, tmp_path / "a")
    os.rename(b, a)
    os.rename(tmp_path / "a", b)
    argv = ["to-hf", str(nxd), str(tmp_path / "out"), "--quiet"]
    if not metadata:  # an official-looking directory: no ckptconv.json, config given
        (nxd / "ckptconv.json").unlink()
        argv += ["--config", str(hf / "config.json"), "--qkv-linear", "--kv-size-multiplier", "1"]
    code, err = run(argv, capsys)
    assert code == 1
    assert err == (f"ckptconv: error: {a}: holds the shard saved as dp_rank_00_tp_rank_01_pp_rank_00.pt (tp rank 1, "
                   "pp rank 0), not tp rank 0 pp rank 0; rank files were swapped or renamed (pass --no-check to "
                   "read it anyway)\n")


def test_swapped_xser_tensor_files_are_caught_by_digest(tiny_models, tmp_path):
    """xser split tensor files are all named tensor_<tid>: only the recorded digest tells ranks apart."""
    hf = tiny_models("checked-gqa", **GQA)
    nxd = tmp_path / "split"
    ckptconv.to_nxd(hf, nxd, tp=2, attention="qkv_linear", flavour="xser-split", options=QUIET)
    a = nxd / (SHARD.format(0, 0) + ".tensors/tensor_3.pt")
    b = nxd / (SHARD.format(1, 0) + ".tensors/tensor_3.pt")
    assert a.stat().st_size == b.stat().st_size
    os.rename(a, tmp_path / "a")
    os.rename(b, a)
    os.rename(tmp_path / "a", b)
    with pytest.raises(IntegrityError, match=re.escape(f"{a}: blake3 ") + r"[0-9a-f]{64}, ckptconv.json records"):
        ckptconv.to_hf(nxd, tmp_path / "out", options=QUIET)


def test_flipped_byte_without_metadata_is_a_crc_error(converted, tmp_path, capsys):
    hf, src = converted
    nxd = copy(src, tmp_path / "nxd")
    (nxd / "ckptconv.json").unlink()
    path = nxd / SHARD.format(0, 1)
    record, offset = record_of(path, "lm_head.weight")  # not replicated: only the CRC can tell
    flip(path, offset + 4)
    code, err = run(["to-hf", str(nxd), str(tmp_path / "out"), "--quiet", "--config", str(hf / "config.json"),
                     "--qkv-linear", "--kv-size-multiplier", "1"], capsys)
    assert code == 1
    assert re.fullmatch(CRC_ERROR.format(path=re.escape(str(path)), record=re.escape(record)), err), err


def consume(check: StreamCheck, data: bytes, start: int, stop: int, fill) -> None:
    check.begin(start, stop - start)
    check.consumed_bytes(start, memoryview(data[start:stop]), fill)


def test_stream_check_hashes_out_of_order_reads_once(tmp_path):
    """Reads in shuffled order: the digest and record CRCs equal the reference values, and the check
    reads (from the page cache) each byte at most once, only what it could not hash as it came."""
    rng = random.Random(0)
    data = rng.randbytes(3 * 2**20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    records = [ZipCrc("a", 10, 2**20, crc32(data[10:10 + 2**20])), ZipCrc("empty", 2**20 + 10, 0, 0),
               ZipCrc("b", 2**20 + 64, 2**20, crc32(data[2**20 + 64:2 * 2**20 + 64]))]
    pulled: list[tuple[int, int]] = []

    def fill(offset: int, view: memoryview) -> None:
        pulled.append((offset, len(view)))
        view[:] = data[offset:offset + len(view)]

    record = FileRecord(len(data), "blake3", blake3.blake3(data).hexdigest())
    check = StreamCheck(path, record)
    check.set_zip_records(records)
    bands = [(o, min(o + 65536, 2 * 2**20)) for o in range(0, 2 * 2**20, 65536)]
    rng.shuffle(bands)
    for start, stop in bands:
        consume(check, data, start, stop, fill)
    check.finish(fill)  # no error: digest and both CRCs matched
    end = 0
    for offset, n in pulled:
        assert offset >= end
        end = offset + n
    assert end == len(data) and check.pos == len(data)
    assert sum(n for offset, n in pulled if offset >= 2 * 2**20) == 2**20  # the unread tail
    assert sum(n for _, n in pulled) < len(data)  # bands that came in order were hashed as they came

    bad = bytearray(data)
    bad[2**20 + 100] ^= 1  # inside record b
    check = StreamCheck(path, record)
    check.set_zip_records(records)
    with pytest.raises(IntegrityError, match=r"record b has CRC-32 [0-9a-f]{8}, the zip directory records"):
        consume(check, bytes(bad), 0, 2 * 2**20 + 64, fill)


def test_stream_check_waits_for_reads_in_flight_and_skips_far_reads(tmp_path):
    data = random.Random(1).randbytes(4 * 2**20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    pulled: list[int] = []

    def fill(offset: int, view: memoryview) -> None:
        pulled.append(len(view))
        view[:] = data[offset:offset + len(view)]

    check = StreamCheck(path, FileRecord(len(data), "sha256", hashlib.sha256(data).hexdigest()))
    half = 2 * 2**20
    check.begin(0, half)  # worker A is copying the first half ...
    ahead = threading.Thread(target=consume, args=(check, data, half, len(data), fill))
    ahead.start()  # ... when worker B delivers the second: B waits for A instead of reading A's bytes
    check.consumed_bytes(0, memoryview(data[:half]), fill)
    ahead.join(timeout=60)
    assert not ahead.is_alive() and check.pos == len(data) and pulled == []
    check.finish(fill)

    far = StreamCheck(path, None)  # a lone read far ahead (a replica check) is left for later, not pulled now
    consume(far, data, SMALL_GAP + 1, SMALL_GAP + 2, fill)
    assert pulled == [] and far.pos == 0
