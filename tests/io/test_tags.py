"""What a training tag is on disk (ckptconv.io.tags): its name built and parsed back, the one marker order."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptconv.io.tags import (
    CHECKPOINT_MARKER,
    DONE_MARKER,
    TAG_MARKERS,
    completed_tags,
    is_step_tag,
    newest_tag,
    tag_name,
    tag_step,
    write_markers,
)


@pytest.mark.parametrize("step", [0, 7, 120, 10**9])
def test_a_tag_name_is_read_back_as_its_step(step):
    assert tag_step(tag_name(step)) == step and is_step_tag(tag_name(step))


@pytest.mark.parametrize(("name", "step"), [("step_12", 12), ("x--step=5-consumed_samples=40.0.ckpt", 5),
                                            ("best", None), ("step_", None), ("not_step_3", None)])
def test_tag_step_of_both_namings(name, step):
    assert tag_step(name) == step
    assert is_step_tag(name) == (step is not None and name.startswith("step_"))


def test_the_markers_are_written_checkpoint_then_done_and_only_done_completes(tmp_path: Path):
    assert TAG_MARKERS == (CHECKPOINT_MARKER, DONE_MARKER) == ("checkpoint", "done")  # NxD's names, this order
    for step in (3, 12):
        (tmp_path / tag_name(step)).mkdir()
    write_markers(tmp_path / tag_name(3))
    (tmp_path / tag_name(12) / CHECKPOINT_MARKER).write_text("1")  # an interrupted save: no done
    assert [(tmp_path / tag_name(3) / m).read_bytes() for m in TAG_MARKERS] == [b"1", b"1"]
    assert completed_tags(tmp_path) == [tmp_path / tag_name(3)]
    assert newest_tag(tmp_path) == (tmp_path / tag_name(3), None)
