"""One source of truth for a checkpoint's layout (issue #21, item 1).

What ``ckptconv.json`` records beats every default (nxd-compat's included); a flag that contradicts
it is refused naming both values unless ``--override-recorded-layout``; shards without a record
whose K/V replica order cannot tell trn1 from the official converter's trn2 are refused, never
guessed; no message recommends ``--kv-replicas`` where the layout flags are what is wrong.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.cli.main import main
from ckptconv.core.layout_flags import LayoutHints
from tests.conftest import GOLDEN, hf_state, warns_no_tokenizer, warns_official_trn2_kv

# 8 query heads, 2 KV heads: tp 4 needs kv_size_multiplier 2, where trn1 and trn2 place heads differently
GQA = dict(heads=8, kv_heads=2, head_dim=8, layers=4)
QUIET = ckptconv.RunOptions(quiet=True, workers=2)
OFFICIAL_TRN1_KVM2 = GOLDEN / "gqa_tp4_pp2_kvm2_fused_xser_trn1"


@pytest.fixture(scope="module")
def gqa(tiny_models) -> Path:
    return tiny_models("gqa-truth", **GQA)


@pytest.fixture(scope="module")
def merged(gqa: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The official tool's input: one torch.save of the HF state dict."""
    path = tmp_path_factory.mktemp("merged") / "merged.pt"
    torch.save(hf_state(gqa), path)
    return path


def cli(*argv: object) -> int:
    return main([str(a) for a in argv])


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error printed"
    return err[-1]


def assert_same_as(state: dict[str, torch.Tensor], reference: Path) -> None:
    expected = hf_state(reference)
    assert set(state) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key


def unrecorded(out: Path) -> Path:
    """Shards as another tool leaves them: no ckptconv.json, no hf/ side files."""
    (out / "ckptconv.json").unlink()
    shutil.rmtree(out / "hf", ignore_errors=True)
    return out


def test_compat_trn2_round_trip_is_exact_without_hw_backend(gqa: Path, merged: Path, tmp_path: Path):
    """The issue's reproduction: the recorded hw=trn2 wins over nxd-compat's official default (trn1)."""
    config = gqa / "config.json"
    assert cli("nxd-compat", "--convert_from_full_state", "--input_dir", merged, "--config", config,
               "--output_dir", tmp_path / "out", "--tp_size", 4, "--pp_size", 2, "--kv_size_multiplier", 2,
               "--qkv_linear", "True", "--fuse_qkv", "True", "--save_xser", "True", "--hw_backend", "trn2",
               "--quiet") == 0
    assert cli("nxd-compat", "--convert_to_full_state", "--input_dir", tmp_path / "out" / "model", "--config", config,
               "--output_dir", tmp_path / "full", "--tp_size", 4, "--pp_size", 2, "--quiet") == 0
    assert_same_as(torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True), gqa)


def test_flag_contradicting_the_record_is_refused(gqa: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "trn2"
    ckptconv.to_nxd(gqa, out, tp=4, kv_size_multiplier=2, attention="qkv_linear", hw_backend="trn2", options=QUIET)
    assert cli("to-hf", out, tmp_path / "a", "--hw-backend", "trn1", "--quiet") == 1
    line = error_line(capsys)
    assert "--hw-backend trn1 contradicts" in line and "records hw trn2" in line
    assert "--override-recorded-layout" in line and "--kv-replicas" not in line
    assert not (tmp_path / "a").exists()
    assert cli("nxd-compat", "--convert_to_full_state", "--input_dir", out / "model", "--config", gqa / "config.json",
               "--output_dir", tmp_path / "b", "--hw_backend", "trn1", "--quiet") == 1
    assert "--hw_backend trn1 contradicts" in error_line(capsys)
    assert cli("to-hf", out, tmp_path / "c", "--tp", 2, "--quiet") == 1
    line = error_line(capsys)
    assert "--tp 2 contradicts" in line and "records tp 4" in line
    # The same value as the record is no contradiction.
    assert cli("to-hf", out, tmp_path / "d", "--hw-backend", "trn2", "--kv-size-multiplier", 2, "--quiet") == 0
    assert_same_as(hf_state(tmp_path / "d"), gqa)


def test_override_says_what_it_overrides_and_never_recommends_kv_replicas(
        gqa: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Reading trn2 (adjacent replicas) as trn1 would pair heads wrongly: the replica order refuses it,
    naming the layout flags, not --kv-replicas (whose first|mean would export wrong weights)."""
    out = tmp_path / "trn2"
    ckptconv.to_nxd(gqa, out, tp=4, kv_size_multiplier=2, attention="qkv_linear", hw_backend="trn2", options=QUIET)
    assert cli("to-hf", out, tmp_path / "a", "--hw-backend", "trn1", "--override-recorded-layout", "--quiet") == 1
    line = error_line(capsys)
    assert "adjacent ranks" in line and "--hw-backend" in line and "layout flags are wrong" in line
    assert "--kv-replicas" not in line
    # An override the shards do not contradict goes through, and the notes say what it overrode.
    official = tmp_path / "official"
    with warns_official_trn2_kv():
        ckptconv.to_nxd(gqa, official, tp=4, kv_size_multiplier=2, attention="qkv_linear", hw_backend="trn2",
                        trn2_kv_layout="official", options=QUIET)
    with warns_no_tokenizer():
        result = ckptconv.to_hf(official, tmp_path / "b", options=QUIET,
                                hints=LayoutHints({"hw": "trn1"}, override=True))
    assert any("--override-recorded-layout: reading with --hw-backend trn1 instead of the recorded hw trn2" in n
               for n in result.notes)


def test_official_trn2_shards_are_refused_without_flags_and_exact_with_them(
        gqa: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """The official converter's trn2 kvm>1 shards tile K/V like trn1 and differ only in query-head
    order: without a record they are refused naming the flags, never read as trn1."""
    with warns_official_trn2_kv():
        shards = unrecorded(ckptconv.to_nxd(gqa, tmp_path / "nxd", tp=4, pp=2, kv_size_multiplier=2,
                                            attention="qkv_linear", fuse_qkv=True, hw_backend="trn2",
                                            trn2_kv_layout="official", options=QUIET).out)
    config = gqa / "config.json"
    assert cli("to-hf", shards, tmp_path / "a", "--config", config, "--quiet") == 1
    line = error_line(capsys)
    assert "--hw-backend trn2 --trn2-kv-layout official" in line and "--hw-backend trn1" in line
    assert not (tmp_path / "a").exists()
    assert cli("to-hf", shards, tmp_path / "b", "--config", config, "--hw-backend", "trn2", "--quiet") == 1
    assert "layout flags are wrong" in error_line(capsys)
    assert cli("to-hf", shards, tmp_path / "c", "--config", config, "--hw-backend", "trn2",
               "--trn2-kv-layout", "official", "--quiet") == 0
    assert_same_as(hf_state(tmp_path / "c"), gqa)
    assert cli("nxd-compat", "--convert_to_full_state", "--input_dir", shards / "model", "--config", config,
               "--output_dir", tmp_path / "d", "--quiet") == 1
    assert "--hw_backend trn2 --trn2_kv_layout official" in error_line(capsys)


def test_official_trn1_kvm2_golden_shards_need_hw_backend(golden_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]):
    """The official tool's own trn1 kvm2 output: tiled, so refused without --hw-backend; exact with it."""
    case = golden_dir / OFFICIAL_TRN1_KVM2.name
    config = case / "hf" / "config.json"
    assert cli("to-hf", case / "out", tmp_path / "a", "--config", config, "--quiet") == 1
    assert "--hw-backend trn2 --trn2-kv-layout official" in error_line(capsys)
    assert cli("to-hf", case / "out", tmp_path / "b", "--config", config, "--hw-backend", "trn1", "--quiet") == 0
    assert_same_as(hf_state(tmp_path / "b"), case / "hf")


def test_newest_tag_is_the_highest_step_and_a_different_nxd_choice_is_warned(gqa: Path, tmp_path: Path):
    """NxD resumes the tag whose done marker was modified last; we take the highest step, and say
    so when the two differ (a copy that lost the timestamps)."""
    from ckptconv.io.nxd import resolve_checkpoint

    root = tmp_path / "ckpt"
    for step in (4, 8):
        ckptconv.to_nxd(gqa, root / f"step_{step}", tp=2, options=QUIET)
        (root / f"step_{step}" / "done").write_text("1")
    os.utime(root / "step_4" / "done", (1_000_000, 1_000_000))
    os.utime(root / "step_8" / "done", (1_000_000, 1_000_000))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # equal timestamps: both rules agree, nothing to warn about
        assert resolve_checkpoint(root)[0] == root / "step_8"
    os.utime(root / "step_4" / "done", (2_000_000, 2_000_000))  # step_4's marker now looks newer
    with pytest.warns(UserWarning, match=r"took step_8, the highest step; NxD's load_checkpoint would take step_4"):
        tag, _, how = resolve_checkpoint(root)
    assert tag == root / "step_8" and "highest step" in how


# --------------------------------------------------------------------------------------------
# Item 5: exports keep what the source had


TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "tokenizer.json"


def test_pt_source_with_tokenizer_exports_a_loadable_tokenizer(gqa: Path, merged: Path, tmp_path: Path):
    from transformers import AutoTokenizer

    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    shutil.copy(TOKENIZER, tokenizer_dir / "tokenizer.json")
    expected = AutoTokenizer.from_pretrained(TOKENIZER.parent, tokenizer_file=str(TOKENIZER))("a tiny test")
    assert cli("to-nxd", merged, tmp_path / "nxd", "--config", gqa / "config.json", "--tp", 2,
               "--tokenizer", tokenizer_dir, "--quiet") == 0
    assert (tmp_path / "nxd" / "hf" / "tokenizer.json").read_bytes() == TOKENIZER.read_bytes()
    assert cli("to-hf", tmp_path / "nxd", tmp_path / "hf", "--quiet") == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("a tiny test")["input_ids"] == expected["input_ids"]
    # to-hf --tokenizer adds one to an export whose source kept none
    assert cli("to-nxd", merged, tmp_path / "bare", "--config", gqa / "config.json", "--tp", 1, "--quiet") == 0
    assert cli("to-hf", tmp_path / "bare", tmp_path / "hf2", "--tokenizer", tokenizer_dir, "--quiet") == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "hf2")("a tiny test")["input_ids"] == expected["input_ids"]


def test_export_without_tokenizer_warns(gqa: Path, merged: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert cli("to-nxd", merged, tmp_path / "nxd", "--config", gqa / "config.json", "--tp", 1) == 0
    assert "no tokenizer beside" in capsys.readouterr().out  # a note in the result
    with pytest.warns(UserWarning, match=r"will have no tokenizer .* to-hf --tokenizer DIR"):
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "hf", options=QUIET)
    assert cli("to-hf", tmp_path / "nxd", tmp_path / "x", "--tokenizer", gqa, "--quiet") == 1
    assert "--tokenizer" in capsys.readouterr().err  # a directory without any tokenizer file is refused


def test_fp32_source_trained_in_bf16_exports_fp32(gqa: Path, tmp_path: Path):
    """An fp32 model trained with bf16 weights: the export writes fp32, the source's dtype, from the fp32
    master weights in optim/ (the bf16 shards are their rounding); --no-masters widens the bf16 shards;
    --dtype keep --no-masters writes the shards' bf16."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    ckptconv.to_nxd(gqa, tmp_path / "nxd", tp=2, options=QUIET)
    run = subprocess.run([sys.executable, "-m", "nxdtrain.cli", "run", "--resume", str(tmp_path / "nxd"), "--tp", "2",
                          "--nproc", "2", "--steps", "2", "--precision", "bf16", "--data", "synthetic", "--seq-len", "16",
                          "--gbs", "2", "--mbs", "1", "--lr", "1e-3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                          "--export-hf", str(tmp_path / "hf")], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    tag = tmp_path / "ckpt" / "step_2"
    assert {t.dtype for t in torch.load(tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt",
                                        weights_only=True).values()} == {torch.bfloat16}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float32"
    masters = load_file(tmp_path / "hf" / "model.safetensors")
    assert {t.dtype for t in masters.values()} == {torch.float32}
    with warns_no_tokenizer():
        ckptconv.to_hf(tag, tmp_path / "kept", dtype="keep", masters=False, options=QUIET)
    kept = load_file(tmp_path / "kept" / "model.safetensors")
    assert {t.dtype for t in kept.values()} == {torch.bfloat16}
    with warns_no_tokenizer():
        widened = ckptconv.to_hf(tag, tmp_path / "widened", masters=False, options=QUIET)
    assert any("writing float32" in n and "widened" in n for n in widened.notes)
    for key, tensor in load_file(tmp_path / "widened" / "model.safetensors").items():
        assert torch.equal(tensor, kept[key].float()), key
        assert torch.equal(masters[key].to(torch.bfloat16), kept[key]), key  # the shards are the masters rounded
    assert any(not torch.equal(masters[k], kept[k].float()) for k in kept)  # and the masters say more
    with pytest.raises(ckptconv.ConversionError, match="no nxdtrain master weights"):
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "none", masters=True, options=QUIET)


def test_inspect_describes_undecided_shards_without_guessing(golden_dir: Path):
    """inspect still describes tiled unrecorded shards, with the hardware left open and why."""
    case = golden_dir / OFFICIAL_TRN1_KVM2.name
    report = ckptconv.inspect(case / "out", config=case / "hf" / "config.json")
    assert report["layout"]["hw"] == "trn1|trn2-official" and report["layout"]["kvm"] == 2
    assert any(n.startswith("hw undecided:") and "--trn2-kv-layout official" in n for n in report["notes"])
    assert not any("hw=trn1" in n for n in report["notes"])


def test_reshard_of_undecided_shards_takes_the_source_hardware(golden_dir: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]):
    """reshard's --hw-backend names the output's; an unrecorded tiled source needs --source-hw-backend."""
    case = golden_dir / OFFICIAL_TRN1_KVM2.name
    config = case / "hf" / "config.json"
    assert cli("reshard", case / "out", tmp_path / "a", "--tp", 2, "--config", config, "--quiet") == 1
    assert "--source-hw-backend trn2 --source-trn2-kv-layout official" in error_line(capsys)
    assert cli("reshard", case / "out", tmp_path / "b", "--tp", 2, "--config", config,
               "--source-hw-backend", "trn1", "--quiet") == 0
    assert cli("to-hf", tmp_path / "b", tmp_path / "hf", "--quiet") == 0
    assert_same_as(hf_state(tmp_path / "hf"), case / "hf")
