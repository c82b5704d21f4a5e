"""verify of a training tag that nxdtrain trained: against the HF model it started from the difference is the
training's, said first and blamed on no rank; against the tag's own export the shards verify as usual.

The tag is trained by nxdtrain's own CLI (2 processes, tp 2, 2 steps at a high learning rate, so every layer moved);
the numbers verify reports are compared with nothing here but the tag's record: the point is what verify says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ckptconv
from ckptconv.cli.main import main
from ckptconv.commands.verify import verify
from tests.conftest import warns_no_tokenizer
from tests.faults.helpers import run

STEPS = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> tuple[Path, Path, Path]:
    """(the HF model, its shards at tp 2, the tag nxdtrain saved after training them STEPS steps)."""
    hf = tiny_models("gqa2", heads=8, kv_heads=2, layers=3)
    root = tmp_path_factory.mktemp("trained")
    ckptconv.to_nxd(hf, root / "nxd", tp=2, pp=1, options=ckptconv.RunOptions(quiet=True, workers=1))
    done = run("nxdtrain", "run", "--nproc", "2", "--resume", root / "nxd", "--tp", "2", "--pp", "1",
               "--data", "synthetic", "--seq-len", "16", "--gbs", "4", "--mbs", "1", "--steps", str(STEPS),
               "--lr", "1e-2", "--warmup", "0", "--precision", "fp32", "--checkpoint-dir", root / "ck")
    assert done.returncode == 0, done.stderr
    tag = root / "ck" / f"step_{STEPS}"
    assert json.loads((tag / "ckptconv.json").read_text())["extra"]["nxdtrain"]["step"] == STEPS
    return hf, root / "nxd", tag


def test_a_trained_tag_against_its_starting_model_is_said_trained_first(trained):
    hf, _, tag = trained
    result = verify(hf, tag)
    said = (f"{tag} is a training tag trained {STEPS} steps (its ckptconv.json records step {STEPS}) and {hf} is not "
            "its export: their weights differ by the training, not by the conversion (")
    assert result["trained"]["steps"] == STEPS and result["trained"]["message"].startswith(said)
    assert result["notes"][0] == result["trained"]["message"]
    assert result["ok"] is False and result["problems"] == [result["trained"]["message"]]
    assert f"ckptconv to-hf {tag} EXPORT, then ckptconv verify EXPORT {tag}" in result["problems"][0]
    checks = [c for layer in result["layers"].values() for c in layer.values()]
    assert [c for c in checks if c["rel"] > result["tol"]], "the training moved the weights"
    assert all(c["ranks"] == [] and c["detail"] == "" for c in checks), "no rank is blamed for training"


def test_the_cli_says_it_before_any_number_and_blames_nothing(trained, capsys: pytest.CaptureFixture[str]):
    hf, _, tag = trained
    assert main(["verify", str(hf), str(tag)]) == 1
    out, err = capsys.readouterr()
    first, *rest = out.splitlines()
    assert first.startswith(f"note: {tag} is a training tag trained {STEPS} steps")
    assert rest[-1] == "DIFFERS: by the training, not the conversion (see the first line)"
    assert err.startswith(f"ckptconv: verify: {tag} is a training tag") and err.count("\n") == 1
    assert "rank" not in out + err and "FAILED" not in out and "verify failed" not in err


def test_the_tags_own_export_verifies_it(trained, tmp_path: Path):
    hf, _, tag = trained
    with warns_no_tokenizer():
        ckptconv.to_hf(tag, tmp_path / "export", options=ckptconv.RunOptions(quiet=True))
    result = verify(tmp_path / "export", tag)
    assert result["ok"] is True and "trained" not in result, result["problems"]


def test_untrained_shards_are_checked_as_before(trained):
    hf, nxd, _ = trained
    result = verify(hf, nxd)
    assert result["ok"] is True and "trained" not in result


def test_no_rank_reads_as_a_missing_value(trained, capsys: pytest.CaptureFixture[str]):
    hf, nxd, _ = trained
    assert main(["verify", str(hf), str(nxd)]) == 0
    out = capsys.readouterr().out
    assert "ranks -" not in out and "ranks " not in out
    assert out.splitlines()[-1] == "OK: the shards compute what the HF model computes"


def test_layers_all_shows_a_progress_bar_unless_quiet(trained, capsys: pytest.CaptureFixture[str]):
    hf, nxd, _ = trained
    verify(hf, nxd, layers="all", progress=True)
    assert "3/3 layers" in capsys.readouterr().err
    verify(hf, nxd, layers="all")
    assert capsys.readouterr().err == ""
