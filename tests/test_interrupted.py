"""What a user meets after Ctrl-C and after an incomplete download: the interrupted OUT is named as such with the
fix (rerun the same command), the rerun says what it kept and counts only what it wrote, and a truncated
safetensors file is called truncated, with the size it has and the size its header needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.cli.main import main
from ckptconv.engine import execute
from ckptconv.engine.outdir import TMP_DIR

RERUN = "rerun the same command to finish it"


@pytest.fixture
def interrupted(tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, list[Path]]:
    """(the HF model, an OUT whose to-nxd was interrupted after two of its four shards, those two shards)."""
    src = tiny_models("gqa", heads=8, kv_heads=2, head_dim=8, layers=6)
    out = tmp_path / "nxd"
    real = execute.move_into_place
    calls = {"n": 0}

    def interrupt_on_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # Ctrl-C
        return real(*args, **kwargs)

    monkeypatch.setattr(execute, "move_into_place", interrupt_on_third)
    with pytest.raises(KeyboardInterrupt):
        ckptconv.to_nxd(src, out, tp=2, pp=2, options=ckptconv.RunOptions(quiet=True, workers=1))
    monkeypatch.setattr(execute, "move_into_place", real)
    finished = sorted((out / "model").glob("*.pt"))
    assert len(finished) == 2 and not (out / "ckptconv.json").exists() and (out / TMP_DIR).is_dir()
    return src, out, finished


def test_readers_of_an_interrupted_out_say_rerun(interrupted, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    src, out, _ = interrupted
    for argv in (["inspect", str(out)], ["to-hf", str(out), str(tmp_path / "hf")], ["verify", str(src), str(out)],
                 ["reshard", str(out), str(tmp_path / "tp1"), "--tp", "1", "--pp", "1"]):
        assert main([*argv, "--quiet"] if argv[0] in ("to-hf", "reshard") else argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith(f"ckptconv: error: {out}: an interrupted conversion (no ckptconv.json yet; "
                              f"{TMP_DIR}/ holds its progress); {RERUN}"), (argv, err)
        assert err.rstrip().endswith("the files it finished are kept") and err.count("\n") == 1, err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "tp1" / "ckptconv.json").exists()


def test_the_rerun_says_what_it_kept_and_counts_only_what_it_wrote(interrupted):
    src, out, finished = interrupted
    result = ckptconv.to_nxd(src, out, tp=2, pp=2, options=ckptconv.RunOptions(quiet=True, workers=1))
    shards = sum(_tensor_bytes(p) for p in (out / "model").glob("*.pt"))
    kept = sum(_tensor_bytes(p) for p in finished)
    assert 0 < kept < shards
    assert result.bytes_written == shards - kept  # not every byte of OUT: the two kept shards were not written
    said = [n for n in result.notes if n.startswith("resumed:")]
    assert said == [f"resumed: 2 files / {ckptconv.core.human_bytes(kept)} kept from the interrupted run; "
                    "bytes_written counts only what this run wrote"]
    fresh = ckptconv.to_nxd(src, out.with_name("fresh"), tp=2, pp=2, options=ckptconv.RunOptions(quiet=True))
    assert fresh.bytes_written == shards and not [n for n in fresh.notes if n.startswith("resumed:")]


def _tensor_bytes(shard: Path) -> int:
    """The tensor bytes a shard holds, as torch reads it (the count bytes_written is in)."""
    return sum(t.numel() * t.element_size() for t in torch.load(shard, weights_only=True).values())


def test_another_conversion_in_out_names_overwrite_and_what_it_deletes(tiny_models, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]):
    src = tiny_models("gqa", heads=8, kv_heads=2, head_dim=8, layers=6)
    out = tmp_path / "out"
    assert main(["to-nxd", str(src), str(out), "--tp", "2", "--quiet"]) == 0
    assert main(["to-nxd", str(src), str(out), "--tp", "1", "--quiet"]) == 1
    assert capsys.readouterr().err.endswith(
        "; choose another OUT, or pass --overwrite to delete that conversion's files and write this one instead\n")
    (out / "notes.txt").write_text("a user's")  # --overwrite would refuse: it is not suggested
    assert main(["to-nxd", str(src), str(out), "--tp", "1", "--quiet"]) == 1
    assert "--overwrite" not in capsys.readouterr().err


def _truncated(tiny_models, tmp_path: Path) -> tuple[Path, Path, int]:
    src = tiny_models("gqa", heads=8, kv_heads=2, head_dim=8, layers=6)
    cut = tmp_path / "download"
    cut.mkdir()
    for p in src.iterdir():
        (cut / p.name).write_bytes(p.read_bytes())
    weights = cut / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    return cut, weights, size


def test_a_truncated_safetensors_file_is_called_truncated(tiny_models, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]):
    cut, weights, size = _truncated(tiny_models, tmp_path)
    said = (f"{weights}: truncated (an incomplete download?): the file is {size // 2} bytes, its header needs {size}; "
            "download or copy it again")
    assert main(["to-nxd", str(cut), str(tmp_path / "out"), "--tp", "2", "--quiet"]) == 1
    assert capsys.readouterr().err == f"ckptconv: error: {said}\n"
    assert main(["inspect", str(cut), "--json"]) == 0  # inspect reports it, as it reports incomplete shards
    report = json.loads(capsys.readouterr().out)
    assert report["complete"] is False and report["problems"] == [said]
