"""``--overwrite`` and OUT placement: a conversion removes only what a ckptconv writer recorded.

Every test here lost data on the code before #10: SRC == OUT deleted the source, SRC inside OUT
emptied it, --overwrite removed ``.git/`` and a user's files.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ckptconv.cli.main import main
from tests.faults.helpers import consistent, one_line_error, tree


def _convert(*argv: str | Path) -> int:
    return main([*map(str, argv), "--quiet", "--workers", "2"])


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_src_equal_to_out_is_refused(hf_copy: Path, overwrite: list[str], capsys: pytest.CaptureFixture[str]):
    before = tree(hf_copy)
    assert _convert("to-nxd", hf_copy, hf_copy, "--tp", "1", *overwrite) == 1
    assert one_line_error(capsys.readouterr().err) == f"ckptconv: error: {hf_copy}: is the source {hf_copy} itself; choose another OUT"
    assert tree(hf_copy) == before


def test_out_symlink_to_src_is_refused(hf_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    link = tmp_path / "link"
    link.symlink_to(hf_copy)
    before = tree(hf_copy)
    assert _convert("to-nxd", hf_copy, link, "--tp", "1", "--overwrite") == 1
    assert "is the source" in one_line_error(capsys.readouterr().err)
    assert tree(hf_copy) == before


def test_src_inside_out_is_refused(fault_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    work = tmp_path / "w"
    src = Path(shutil.copytree(fault_hf, work / "hf"))
    before = tree(work)
    assert _convert("to-nxd", src, work, "--tp", "2", "--overwrite") == 1
    assert one_line_error(capsys.readouterr().err) == (
        f"ckptconv: error: {work}: holds the source {src}; choose an OUT that does not contain it")
    assert tree(work) == before


def test_out_inside_src_is_refused(hf_copy: Path, capsys: pytest.CaptureFixture[str]):
    before = tree(hf_copy)
    assert _convert("to-nxd", hf_copy, hf_copy / "nxd", "--tp", "2") == 1
    assert one_line_error(capsys.readouterr().err) == (
        f"ckptconv: error: {hf_copy / 'nxd'}: lies inside the source {hf_copy}; choose an OUT outside it")
    assert tree(hf_copy) == before


@pytest.mark.parametrize("command", ["to-hf", "reshard"])
def test_nxd_src_inside_out_is_refused(command: str, fault_nxd: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    work = tmp_path / "w"
    src = Path(shutil.copytree(fault_nxd, work / "nxd"))
    before = tree(work)
    extra = ["--tp", "1"] if command == "reshard" else []
    assert _convert(command, src, work, *extra, "--overwrite") == 1
    assert "holds the source" in one_line_error(capsys.readouterr().err)
    assert tree(work) == before


def test_overwrite_refuses_foreign_files(hf_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    (out / ".git").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / "notes.txt").write_text("weeks of notes")
    before = tree(out)
    assert _convert("to-nxd", hf_copy, out, "--tp", "2", "--overwrite") == 1
    assert one_line_error(capsys.readouterr().err) == (
        f"ckptconv: error: {out}: --overwrite only replaces files a ckptconv conversion recorded; '.git/' is not "
        "one of them; choose another OUT (or move that file away yourself)")
    assert tree(out) == before


def test_overwrite_replaces_only_an_earlier_conversion(hf_copy: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]):
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    assert _convert("to-nxd", hf_copy, out, "--tp", "2") == 0
    assert _convert("to-nxd", hf_copy, out, "--tp", "1") == 1  # a different conversion: refused
    err = one_line_error(capsys.readouterr().err)  # --overwrite named with what it deletes: ckptconv's own files
    assert err.endswith("choose another OUT, or pass --overwrite to delete that conversion's files and write this one "
                        "instead")
    earlier = tree(out)
    (out / "model" / "mine.txt").write_text("a user's file among ours")
    assert _convert("to-nxd", hf_copy, out, "--tp", "1", "--overwrite") == 1
    assert "'model/mine.txt' is not one of them" in one_line_error(capsys.readouterr().err)
    (out / "model" / "mine.txt").unlink()
    assert tree(out) == earlier and consistent(out)  # the earlier conversion is untouched
    assert _convert("to-nxd", hf_copy, out, "--tp", "1", "--overwrite") == 0
    assert _convert("to-nxd", hf_copy, fresh, "--tp", "1") == 0
    assert tree(out) == tree(fresh)


def test_planted_tmp_symlink_is_not_followed(hf_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir()
    (out / ".ckptconv-tmp").symlink_to(elsewhere)
    assert _convert("to-nxd", hf_copy, out, "--tp", "2") == 1
    assert one_line_error(capsys.readouterr().err) == (
        f"ckptconv: error: {out / '.ckptconv-tmp'}: is a symbolic link; ckptconv does not write through links inside OUT")
    assert list(elsewhere.iterdir()) == []


def test_planted_symlink_inside_tmp_is_removed_not_followed(hf_copy: Path, tmp_path: Path):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    victim.write_text("keep me")
    (out / ".ckptconv-tmp" / "model").mkdir(parents=True)
    (out / ".ckptconv-tmp" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").symlink_to(victim)
    (out / ".ckptconv-tmp" / "state-0-of-1.json").symlink_to(victim)
    assert _convert("to-nxd", hf_copy, out, "--tp", "2") == 0
    assert victim.read_text() == "keep me"
    assert consistent(out)


def test_side_files_stay_inside_src_and_keep_their_mode(hf_copy: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]):
    secret = tmp_path / "secret.txt"
    secret.write_text("outside SRC")
    (hf_copy / "tokenizer.json").symlink_to(secret)
    (hf_copy / "tokenizer_config.json").write_text('{"private": true}')
    (hf_copy / "tokenizer_config.json").chmod(0o600)
    out, back = tmp_path / "out", tmp_path / "back"
    assert main(["to-nxd", str(hf_copy), str(out), "--tp", "2", "--json"]) == 0
    notes = capsys.readouterr().out
    assert f"skipped {hf_copy / 'tokenizer.json'}: a symbolic link to {secret}, outside {hf_copy}" in notes
    assert not (out / "hf" / "tokenizer.json").exists()
    assert (out / "hf" / "tokenizer_config.json").read_text() == '{"private": true}'
    assert (out / "hf" / "tokenizer_config.json").stat().st_mode & 0o777 == 0o600
    assert main(["to-hf", str(out), str(back), "--quiet"]) == 0
    assert (back / "tokenizer_config.json").stat().st_mode & 0o777 == 0o600
    assert not (back / "tokenizer.json").exists()


def test_hub_cache_snapshot_links_are_inside(fault_hf: Path, tmp_path: Path):
    """An HF hub cache snapshot links every file into the model's blobs/: those are copied."""
    repo = tmp_path / "models--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(fault_hf.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(os.path.relpath(blobs / f"blob{i}", snapshot))
    out = tmp_path / "out"
    assert _convert("to-nxd", snapshot, out, "--tp", "2") == 0
    assert (out / "hf" / "generation_config.json").read_bytes() == (fault_hf / "generation_config.json").read_bytes()
