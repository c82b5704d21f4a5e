"""Tags written before optimizer state by parameter name (format 1, a real one: fixtures/nxdtrain-format1) resume
with their full state: at the same layout and at dp 1 without ZeRO-1, steps 3-4 equal the run that wrote it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.nxdtrain.harness import DIST_TIMEOUT, run_world

FIXTURE = REPO / "fixtures" / "nxdtrain-format1"


@pytest.fixture()
def tag(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE / "step_2", tmp_path / "old" / "step_2"))


def _options() -> tuple[dict, list[float]]:
    run = json.loads((FIXTURE / "run.json").read_text())
    options = {**run["options"], "dist_timeout": DIST_TIMEOUT}
    return options, run["losses"]


def test_format1_zero1_tag_continues_bitwise(tag, tmp_path):
    options, losses = _options()
    log = run_world(4, resume=str(tag), checkpoint_dir=str(tmp_path / "ckpt"), log_jsonl=str(tmp_path / "log.jsonl"),
                    **options)
    assert [(r["step"], r["loss"]) for r in log] == [(3, losses[2]), (4, losses[3])]


def test_format1_zero1_tag_resumes_at_dp1_without_zero1(tag, tmp_path):
    options, losses = _options()
    log = run_world(2, resume=str(tag), checkpoint_dir=str(tmp_path / "ckpt"), log_jsonl=str(tmp_path / "log.jsonl"),
                    **{**options, "zero1": False})
    assert [r["step"] for r in log] == [3, 4]
    assert [r["loss"] for r in log] == losses[2:]  # dp 1 sums the same microbatch gradients: equal here
