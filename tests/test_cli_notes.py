"""Warnings reach a CLI user as notes: once, as ``ckptconv: note: ...``, never as Python's ``file:line: UserWarning:``
with a source line; to-hf says nothing of the tokenizer when it refuses for another reason."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import ckptconv
from ckptconv.cli.main import main
from tests.faults.helpers import run


@pytest.fixture(scope="module")
def shards(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """NxD shards without a tokenizer (their HF model has none): an export of them is warned about."""
    out = tmp_path_factory.mktemp("notes") / "nxd"
    ckptconv.to_nxd(tiny_models("gqa", heads=8, kv_heads=2, head_dim=8, layers=6), out, tp=2,
                    options=ckptconv.RunOptions(quiet=True))
    return out


def test_the_no_tokenizer_notice_is_said_once_as_a_note(shards: Path, tmp_path: Path):
    out = tmp_path / "hf"
    done = run("ckptconv", "to-hf", shards, out)  # a real process: pytest's own capture of warnings is not in the way
    assert done.returncode == 0, done.stderr
    stdout, stderr = done.stdout, done.stderr
    notice = f"{out} will have no tokenizer"
    assert (stdout + stderr).count(notice) == 1 and notice in stdout  # in the result's notes, nowhere else
    assert "UserWarning" not in stderr and ".py:" not in stderr


def test_a_refused_export_says_only_why(shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("a user's")
    assert main(["to-hf", str(shards), str(out), "--quiet"]) == 1
    assert capsys.readouterr().err == (f"ckptconv: error: {out}: not empty; holds files ckptconv did not write "
                                       "('mine.txt'); choose another OUT\n")
    with warnings.catch_warnings(record=True) as caught:  # the library warns of nothing either
        warnings.simplefilter("always")
        with pytest.raises(ckptconv.ConversionError):
            ckptconv.to_hf(shards, out, options=ckptconv.RunOptions(quiet=True))
    assert [str(w.message) for w in caught] == []


def test_warnings_become_notes_once_unless_the_result_says_them(capsys: pytest.CaptureFixture[str]):
    from ckptconv.cli.errors import warnings_as_notes

    with warnings_as_notes("ckptconv", quiet=False) as said:
        warnings.warn("the newest tag is step_3, not step_10", stacklevel=1)
        warnings.warn("the newest tag is step_3, not step_10", stacklevel=1)
        warnings.warn("in the result already", stacklevel=1)
        said.add("in the result already")
    assert capsys.readouterr().err == "ckptconv: note: the newest tag is step_3, not step_10\n"
    with pytest.raises(ValueError), warnings_as_notes("nxdtrain", quiet=False):
        warnings.warn("said before the failure", stacklevel=1)
        raise ValueError("refused")
    assert capsys.readouterr().err == "nxdtrain: note: said before the failure\n"
    with warnings_as_notes("ckptconv", quiet=True):
        warnings.warn("quiet", stacklevel=1)
    assert capsys.readouterr().err == ""
