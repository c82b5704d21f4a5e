"""The tag write protocol (ckptconv.engine.tags) as an in-process writer runs it: claim, write, seal, remove."""

from __future__ import annotations

import json
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
