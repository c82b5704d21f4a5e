"""The tag write protocol (ckptconv.engine.tags) as an in-process writer runs it: claim, write, seal, remove."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ckptconv.core.layout import MODEL_DIR
from ckptconv.engine import outdir
from ckptconv.engine.tags import (
    TAG_ENTRIES,
    claim_tag,
    file_records,
    finish_tag,
    remove_tag,
    save_torch,
)
from ckptconv.io.metadata import METADATA_FILE, Metadata
from ckptconv.io.tags import CHECKPOINT_MARKER, DONE_MARKER, OPTIM_DIR, SCHEDULER_FILE


class Refused(Exception):
    pass


def _meta(files):
    return Metadata(kind="nxd", hf_config={}, files=files, layout={}, flavour="plain", dtype="float32")


def test_a_tag_is_claimed_written_sealed_and_retained_in_that_order(tmp_path: Path):
    tag = tmp_path / "step_1"
    events = []
    lock = claim_tag(tag, "test", lambda stranger: Refused(stranger))
    with lock:
        assert (tag / CHECKPOINT_MARKER).is_file() and not (tag / DONE_MARKER).exists()  # never looks complete
        declared = json.loads((tag / outdir.TMP_DIR / f"{outdir.DECLARED_PREFIX}tag.json").read_text())
        assert sorted(declared) == sorted(TAG_ENTRIES)
        path = save_torch({"step": 1}, tag / SCHEDULER_FILE)
        records = file_records([path], tag)
        finish_tag(tag, _meta(records), retain=lambda: events.append(sorted(p.name for p in tag.iterdir())))
    assert torch.load(tag / SCHEDULER_FILE, weights_only=True) == {"step": 1}
    assert events and {METADATA_FILE, CHECKPOINT_MARKER, DONE_MARKER, SCHEDULER_FILE} <= set(events[0])
    assert set(json.loads((tag / METADATA_FILE).read_text())["files"]) == {SCHEDULER_FILE}


def test_a_tag_holding_what_we_did_not_write_is_refused_and_kept(tmp_path: Path):
    tag = tmp_path / "step_1"
    tag.mkdir()
    (tag / "notes.txt").write_text("mine")
    with pytest.raises(Refused, match="notes.txt"):
        claim_tag(tag, "test", lambda stranger: Refused(stranger))
    assert (tag / "notes.txt").read_text() == "mine"
    outdir.check_free(tag)  # the lock was released


def _save(tag: Path) -> None:
    with claim_tag(tag, "test", lambda stranger: Refused(stranger)):
        written = [save_torch({}, tag / SCHEDULER_FILE), save_torch({}, tag / MODEL_DIR / "shard.pt"),
                   save_torch({}, tag / OPTIM_DIR / "optim.pt")]
        finish_tag(tag, _meta(file_records(written, tag)))


def test_removing_a_tag_takes_ours_and_leaves_the_foreign(tmp_path: Path):
    tag = tmp_path / "step_1"
    _save(tag)
    (tag / "notes.txt").write_text("mine")
    remove_tag(tag)
    assert sorted(p.name for p in tag.iterdir()) == ["notes.txt"]
    (tag / "notes.txt").unlink()
    _save(tag)
    remove_tag(tag)
    assert not tag.exists()


def test_files_written_in_tag_writes_are_recorded_from_their_digests_as_written(tmp_path: Path, monkeypatch):
    """save_torch inside tag_writes: the record's digest is the file's BLAKE3 (read independently afterwards), taken
    from the bytes as they were written (reading the file back for it fails here), across the rename into place."""
    import blake3

    import ckptconv.io.digest as digest_module
    from ckptconv.engine.tags import tag_writes

    tag = tmp_path / "step_1"
    state = {"state": {"w": {"exp_avg": torch.randn(600, 700), "exp_avg_sq": torch.rand(3)}}, "step": 1}
    with claim_tag(tag, "test", lambda stranger: Refused(stranger)):
        with tag_writes() as digests:
            written = [save_torch(state, tag / OPTIM_DIR / "optim.pt")]
        plain = save_torch({"w": torch.zeros(4, 4)[1]}, tag / SCHEDULER_FILE)  # a view: torch.save, read back
        with monkeypatch.context() as patch:
            patch.setattr(digest_module, "file_digest", lambda *a: pytest.fail("read back a file hashed as written"))
            records = file_records(written, tag, digests)
        records |= file_records([plain], tag, digests)
        finish_tag(tag, _meta(records))
    for rel, record in records.items():
        assert record == {"size": (tag / rel).stat().st_size, "blake3": blake3.blake3((tag / rel).read_bytes()).hexdigest()}
    assert torch.equal(torch.load(tag / OPTIM_DIR / "optim.pt", weights_only=True)["state"]["w"]["exp_avg"],
                       state["state"]["w"]["exp_avg"])


def test_a_file_changed_after_it_was_hashed_is_read_again(tmp_path: Path):
    from ckptconv.engine.tags import tag_writes

    with tag_writes() as digests:
        path = save_torch({"w": torch.arange(10.0)}, tmp_path / "a.pt")
    assert digests.of_file(path) is not None
    with open(path, "ab") as f:
        f.write(b"x")
    assert digests.of_file(path) is None
    assert digests.of_file(save_torch({"w": torch.arange(3.0)}, tmp_path / "b.pt")) is None  # written outside


def test_tag_writes_asked_for_direct_writes_go_direct_where_the_filesystem_allows(tmp_path: Path):
    from ckptconv.engine.tags import tag_writes
    from ckptconv.io import direct_io
    from tests.io.test_direct_io import _supports_direct

    if not hasattr(os, "O_DIRECT") or not _supports_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    before = direct_io.direct_bytes
    state = {"exp_avg": torch.randn(1 << 20)}  # 4 MiB
    with tag_writes(direct=True):
        path = save_torch(state, tmp_path / "optim.pt")
    assert direct_io.direct_bytes - before >= 3 << 20
    assert torch.equal(torch.load(path, weights_only=True)["exp_avg"], state["exp_avg"])
