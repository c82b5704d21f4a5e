"""What a newcomer trips on at nxdtrain's front door (issue 44): --resume of the HF model as downloaded names the
conversion, a warning is said once as ``nxdtrain: note:``, ``export`` takes to-hf's --tokenizer/--quiet/--json, and
a layout flag spelled another way gets "did you mean" with the command's own usage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from nxdtrain.cli import main
from tests.faults.helpers import one_line_error, run

TOKENIZER = Path(__file__).resolve().parents[2] / "fixtures" / "corpus" / "tokenizer.json"


@pytest.fixture(scope="module")
def tag(tmp_path_factory, nxd_model) -> Path:
    """A trained tag (one step, tp 1) of a model without a tokenizer: its export is warned about."""
    from tests.nxdtrain.harness import run_world, train_options

    root = tmp_path_factory.mktemp("front-door")
    run_world(1, **train_options(steps=1, resume=str(nxd_model("gqa2", tp=1, pp=1)), checkpoint_dir=str(root / "ck"),
                                 log_jsonl=str(root / "log.jsonl")))
    return root / "ck" / "step_1"


def test_resume_of_an_hf_folder_names_the_conversion(hf_model, tmp_path):
    hf = hf_model("gqa2")
    done = run("nxdtrain", "run", "--resume", hf, "--data", "synthetic", "--no-checkpoint", "--steps", "1")
    assert done.returncode == 1
    assert one_line_error(done.stderr, "nxdtrain") == (
        f"nxdtrain: error: --resume {hf}: this is a Hugging Face checkpoint (config.json and its weights, no NxD "
        f"shards): convert it with `ckptconv to-nxd {hf} OUT --tp N` first, then --resume OUT")
    # a single-file model (model.safetensors) and an --init of one are the same mistake
    single = tmp_path / "single"
    single.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf / name, single / name)
    assert main(["run", "--resume", "auto", "--checkpoint-dir", str(tmp_path / "ck"), "--init", str(single),
                 "--data", "synthetic", "--steps", "1"]) == 1


def test_the_export_note_is_said_once_as_a_note(tag, tmp_path):
    out = tmp_path / "hf"
    done = run("nxdtrain", "export", tag, out)  # a real process: pytest's capture of warnings is not in the way
    assert done.returncode == 0, done.stderr
    notice = f"{out} will have no tokenizer"
    assert (done.stdout + done.stderr).count(notice) == 1 and notice in done.stdout  # the result's notes say it
    assert "UserWarning" not in done.stderr and ".py:" not in done.stderr


def test_export_takes_to_hf_s_tokenizer_quiet_and_json(tag, tmp_path, capsys):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    shutil.copy(TOKENIZER, tokenizer / "tokenizer.json")
    out = tmp_path / "hf"
    assert main(["export", str(tag), str(out), "--tokenizer", str(tokenizer), "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert captured.err == ""  # --json: no progress, no notes on stderr
    assert Path(result["out"]) == out and f"tokenizer from {tokenizer}: tokenizer.json" in result["notes"]
    assert (out / "tokenizer.json").read_bytes() == TOKENIZER.read_bytes()
    assert not any("no tokenizer" in note for note in result["notes"])
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.embed_tokens.weight" in set(f.keys())
    # --quiet: the result (notes included) on stdout, nothing on stderr; a second export replaces the first
    assert main(["export", str(tag), str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and f"{out} will have no tokenizer" in captured.out


@pytest.mark.parametrize("argv,hint", [
    (["run", "--tp2"], "--tp2: did you mean --tp 2?"),
    (["run", "--tensor-parallel", "2"], "--tensor-parallel: did you mean --tp?"),
    (["run", "--tp_size", "2"], "--tp_size: did you mean --tp?"),
    (["run", "--pipeline-model-parallel-size=2"], "--pipeline-model-parallel-size=2: did you mean --pp?"),
])
def test_a_layout_flag_spelled_another_way_gets_did_you_mean_and_the_command_s_usage(argv, hint, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: nxdtrain run --resume PATH|auto"), err  # run's usage, not the top level's
    assert err.rstrip().endswith(hint), err


@pytest.mark.parametrize("argv,usage", [(["export", "a", "b", "--tp_size", "2"], "usage: nxdtrain export"),
                                        (["data", "pack", "x", "y", "--tokenizer", "t", "--seq-len", "3", "--bogus"],
                                         "usage: nxdtrain data pack")])
def test_no_hint_for_a_flag_the_command_lacks_and_the_innermost_usage(argv, usage, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert err.startswith(usage) and "did you mean" not in err, err


def test_export_hf_of_a_run_says_the_note_once_from_its_processes_too(nxd_model, tmp_path):
    """--nproc 2 --export-hf: rank 0's process exports; its warning is a note there too, said once."""
    out = tmp_path / "hf"
    done = run("nxdtrain", "run", "--nproc", "2", "--resume", nxd_model("gqa2", tp=1, pp=1), "--data", "synthetic",
               "--steps", "1", "--seq-len", "16", "--gbs", "2", "--precision", "fp32",
               "--checkpoint-dir", tmp_path / "ck", "--export-hf", out)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(f"nxdtrain: note: {out} will have no tokenizer") == 1, done.stderr
    assert "UserWarning" not in done.stderr and ".py:" not in done.stderr
