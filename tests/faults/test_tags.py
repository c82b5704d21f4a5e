"""nxdtrain's tags go through the same ownership rules: a save or a prune removes only what
nxdtrain wrote (files its ckptconv.json lists, the markers, what it declared before writing)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckptconv.engine import outdir
from nxdtrain.checkpoint.save import TagWriter
from nxdtrain.checkpoint.tags import prune
from nxdtrain.errors import TrainError


def _complete_tag(root: Path, step: int, extra: dict[str, str] | None = None, run: str = "r1") -> Path:
    """A finished tag as TagWriter leaves it: files, ckptconv.json listing them, then the markers."""
    tag = root / f"step_{step}"
    (tag / "model").mkdir(parents=True)
    (tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").write_bytes(b"weights")
    (tag / "scheduler.pt").write_bytes(b"s")
    files = {"model/dp_rank_00_tp_rank_00_pp_rank_00.pt": {"size": 7}, "scheduler.pt": {"size": 1}}
    (tag / "ckptconv.json").write_text(json.dumps({"tool": "ckptconv", "kind": "nxd", "files": files,
                                                   "extra": {"nxdtrain": {"run": run}}}))
    for name in ("checkpoint", "done"):
        (tag / name).write_text("1")
    for rel, text in (extra or {}).items():
        (tag / rel).write_text(text)
    return tag


def _writer(root: Path) -> TagWriter:
    return TagWriter(root=root, source=SimpleNamespace(root=root / "src"), layout=None, coords=None, zero1=False,
                     flavour=None, keep=1, options={})  # type: ignore[arg-type]


def test_prune_keeps_what_nxdtrain_did_not_write(tmp_path: Path):
    old = _complete_tag(tmp_path, 2, {"model/README.md": "a user's note"})
    new = _complete_tag(tmp_path, 4)
    assert prune(tmp_path, keep=1, run="r1") == [old]
    assert sorted(p.relative_to(old).as_posix() for p in old.rglob("*")) == ["model", "model/README.md"]
    assert (old / "model" / "README.md").read_text() == "a user's note"
    assert (new / "done").is_file()


def test_save_over_a_tag_refuses_foreign_files(tmp_path: Path):
    tag = _complete_tag(tmp_path, 2, {"notes.txt": "mine"})
    with pytest.raises(TrainError, match=r"step_2: holds 'notes.txt', which nxdtrain did not write"):
        _writer(tmp_path)._claim(tag, 2)
    assert (tag / "notes.txt").read_text() == "mine" and (tag / "done").is_file()


@pytest.mark.parametrize("state", ["complete", "interrupted"])
def test_save_over_its_own_tag_starts_it_over(tmp_path: Path, state: str):
    if state == "complete":
        tag = _complete_tag(tmp_path, 2)
    else:  # what a kill -9 during a save leaves: the declaration, some files, no ckptconv.json
        tag = tmp_path / "step_2"
        outdir.declare(tag, "tag", ["model", "optim", "scheduler.pt"])
        (tag / "optim").mkdir()
        (tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").write_bytes(b"half")
    lock = _writer(tmp_path)._claim(tag, 2)
    try:
        # A claimed tag carries its 'checkpoint' marker (no 'done' yet): readers see an interrupted save.
        assert sorted(p.name for p in tag.iterdir()) == [".ckptconv-tmp", "checkpoint", "model", "optim"]
        assert not any((tag / "model").iterdir()) and not any((tag / "optim").iterdir())
    finally:
        lock.release()
